"""Tokenizer, EOS ids, chat template and model-path resolution (all run once per engine
or per request; none of this touches the device)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from ..errors import InvalidRequestError, ModelLoadError, ModelNotFoundError

__all__ = ["apply_chat_template", "load_tokenizer", "resolve_model_path"]

log = logging.getLogger(__name__)


def resolve_model_path(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub id fetched through huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            str(model),
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
            etag_timeout=10,
        )
    except Exception as e:
        raise ModelNotFoundError(
            f"{model!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {e}); pass the path of a downloaded model directory"
        ) from e
    return Path(local)


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The model's tokenizer and the set of token ids that end generation."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from e
    eos: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        try:
            value = json.loads(gen_cfg.read_text()).get("eos_token_id")
        except ValueError as e:
            raise ModelLoadError(f"{gen_cfg} is not valid JSON: {e}") from e
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(int(v) for v in value)
    return tokenizer, frozenset(eos)


# apply_chat_template's own parameters: not template variables, so not for a request to set.
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def apply_chat_template(tokenizer, messages: Any, template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """The prompt text for chat ``messages``, ending with the assistant's turn opening;
    ``template_kwargs`` are extra variables the template sees (``enable_thinking``, ...)."""
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
            raise InvalidRequestError(
                f"chat_template_kwargs must be a dict with string keys, got {template_kwargs!r}",
                param="chat_template_kwargs",
            )
        taken = sorted(_TEMPLATE_CALL_ARGS.intersection(template_kwargs))
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(map(repr, taken))}: the engine sets "
                "how the template is applied", param="chat_template_kwargs",
            )
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequestError(f"messages[{i}].role {m['role']!r} is not one of system/user/assistant/tool")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; pass 'prompt' instead of 'messages'")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception as e:
        raise InvalidRequestError(f"the chat template rejected these messages: {type(e).__name__}: {e}") from e
