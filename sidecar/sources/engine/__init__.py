"""The serving engine's own figures (vLLM, SGLang, TGI, Triton, TensorRT-LLM, llama.cpp) from
its metrics endpoint in the pod: ``families`` (which of its families we read), ``parse`` (text to
figures, no I/O), ``endpoint`` (the reader thread and the series a cycle takes)."""

from sidecar.sources.engine.endpoint import EngineEndpoint, EngineSource, Fetch, Fetched

__all__ = ["EngineEndpoint", "EngineSource", "Fetch", "Fetched"]
