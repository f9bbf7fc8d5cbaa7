"""The judge: how a pod is judged, in one wing.\n"""
