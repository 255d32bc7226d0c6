"""Tokenizer, EOS ids, chat template and model-path resolution (all run once per engine
or per request; none of this touches the device)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from ..errors import InvalidRequestError, ModelLoadError, ModelNotFoundError

__all__ = ["TokenBytes", "apply_chat_template", "load_tokenizer", "resolve_model_path"]

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
            raw = json.loads(gen_cfg.read_text())
        except ValueError as e:
            raise ModelLoadError(f"{gen_cfg} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{gen_cfg} must hold a JSON object, not {type(raw).__name__}")
        value = raw.get("eos_token_id")
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ids):
            raise ModelLoadError(f"{gen_cfg}: eos_token_id must be a token id or a list of them, got {value!r}")
        eos.update(ids)
    return tokenizer, frozenset(eos)


# apply_chat_template's own parameters: not template variables, so not for a request to set.
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def apply_chat_template(tokenizer, messages: Any, template_kwargs: Optional[dict[str, Any]] = None,
                        tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: Optional[bool] = None,
                        continue_final_message: bool = False) -> str:
    """The prompt text for chat ``messages``, ending with the assistant's turn opening;
    ``template_kwargs`` are extra variables the template sees (``enable_thinking``, ...),
    ``tools`` the tools it shows the model (OpenAI's ``{"type": "function", ...}`` dicts).

    ``continue_final_message=True`` ends the text inside the last message instead, right
    after its content, so that the model goes on with it (a reply begun for the model);
    ``add_generation_prompt=False`` ends it after the last message's turn, with no turn
    opened. By default the turn is opened unless the last message is continued; both
    true is refused."""
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError(f"tools must be a list of dicts, got {tools!r}", param="tools")
    for name, flag in (("add_generation_prompt", add_generation_prompt), ("continue_final_message", continue_final_message)):
        if flag is not None and not isinstance(flag, bool):
            raise InvalidRequestError(f"{name} must be a bool, got {flag!r}", param=name)
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    elif add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message=True goes on with the last message, so add_generation_prompt (which opens a "
            "new turn after it) must not be True as well", param="continue_final_message",
        )
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
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise InvalidRequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequestError(f"messages[{i}].role {m['role']!r} is not one of system/user/assistant/tool")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; pass 'prompt' instead of 'messages'")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {})
        )
    except Exception as e:
        raise InvalidRequestError(f"the chat template rejected these messages: {type(e).__name__}: {e}") from e


# --- the bytes of each token --------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes
    stand for themselves, the other 68 are moved to code points 256 and up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenBytes:
    """The exact bytes a token stands for (byte-level BPE, SentencePiece with byte
    fallback, or the token's own text; an added token's bytes are its text). ``special``
    holds the ids a decode with ``skip_special_tokens`` leaves out: the special tokens
    and the added tokens marked special."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_decoder() if "ByteLevel" in repr(decoder) else None
        if self._byte_level is not None:  # each character to its byte, by str.translate
            self._to_latin1 = {ord(c): b for c, b in self._byte_level.items()}
            self._not_byte_level = re.compile("[^" + "".join(map(re.escape, self._byte_level)) + "]")
        special = set(getattr(tokenizer, "all_special_ids", ()))
        added = set(special)
        for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            added.add(token_id)
            if getattr(token, "special", False):
                special.add(token_id)
        self.special = frozenset(special)
        self._added = frozenset(added)

    def __call__(self, token_id: int) -> bytes:
        return self._bytes(token_id, self._tok.convert_ids_to_tokens(token_id))

    def _bytes(self, token_id: int, piece: Optional[str]) -> bytes:
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level is not None and not self._not_byte_level.search(piece):
            return piece.translate(self._to_latin1).encode("latin-1")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id]).encode()

    def vocabulary(self) -> list[Optional[bytes]]:
        """Every token id's bytes (``len(tokenizer)`` entries), None for the special ones
        (a decode may skip those, so their text is not reliably in the output). Added
        tokens not marked special, such as Qwen's ``<tool_call>``, are decoded as their
        text, and have it."""
        pieces = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
        return [None if i in self.special else self._bytes(i, piece) for i, piece in enumerate(pieces)]
