"""graphtap: read and steer a model's internals while vLLM serves it, under torch.compile
and CUDA graphs, through a patch series of hook slots instead of monkeypatches."""

__version__ = "0.1.0"
