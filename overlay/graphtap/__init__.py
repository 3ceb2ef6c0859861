"""graphtap: read and steer a model's internals while vLLM serves it, under torch.compile
and CUDA graphs, through a patch series of hook slots instead of monkeypatches.

`graphtap.Client` talks to graphtap behind `vllm serve` (it needs neither vLLM nor torch).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Client", "GraphtapError"):  # imported on use: httpx is the client's alone
        from graphtap import client

        return getattr(client, name)
    raise AttributeError(f"module 'graphtap' has no attribute {name!r}")
