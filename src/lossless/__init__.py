"""lossless: Orthrus-style dual-view speculative decoding that is honest about exactness.

    import lossless
    model = lossless.load_model("smollm2-135m")   # exact kernels; bf16 where the CPU multiplies it natively
    out = model.generate("Write a haiku about rain.", max_new_tokens=128)   # the cycle this CPU pays for, equal to AR
    out.text, out.token_ids, out.stats, out.config

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
