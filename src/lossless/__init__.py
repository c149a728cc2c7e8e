"""lossless: Orthrus-style dual-view speculative decoding that is honest about exactness.

    import lossless
    model = lossless.load_model("smollm2-135m", dtype="bf16")
    out = model.generate("Write a haiku about rain.", mode="orthrus", max_new_tokens=128)
    out.text, out.token_ids, out.stats

Nothing heavy runs at import; models load on `load_model`.
"""

from .decoding.loop import DecodeConfig, GenerationOutput, decode
from .errors import LosslessError
from .decoding.model import OrthrusLM, generate
from .decoding.models import load_model
from .decoding.sampling import SamplingConfig

__all__ = ["load_model", "OrthrusLM", "generate", "decode", "DecodeConfig", "GenerationOutput",
           "SamplingConfig", "LosslessError"]
__version__ = "0.1.0"
