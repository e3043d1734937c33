"""The hf_cgpu GPT, registered with the transformers Auto classes.

Importing hf_cgpu is enough for ``AutoModelForCausalLM.from_pretrained(dir)``; a saved directory also carries the
two model files (``register_for_auto_class``) so ``trust_remote_code=True`` loads it without hf_cgpu installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_cgpt import CgptConfig
from .modeling_cgpt import CgptForCausalLM, CgptModel, chunked_cross_entropy

AutoConfig.register(CgptConfig.model_type, CgptConfig, exist_ok=True)
AutoModel.register(CgptConfig, CgptModel, exist_ok=True)
AutoModelForCausalLM.register(CgptConfig, CgptForCausalLM, exist_ok=True)
CgptConfig.register_for_auto_class()
CgptForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["CgptConfig", "CgptForCausalLM", "CgptModel", "chunked_cross_entropy"]
