"""The small JSON files of a Hugging Face model directory that the tokenizer needs.

``tokenizer.json`` (the ``tokenizers`` serialization), ``tokenizer_config.json`` (chat template,
BOS/EOS text, ``add_bos_token``), ``chat_template.jinja`` (newer transformers save the template
there), ``generation_config.json`` and ``config.json`` (EOS ids, an int or a list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flm_runtime.errors import ModelFormatError


@dataclass
class HFTokenizerFiles:
    """What a directory says about its tokenizer.

    Attributes:
        tokenizer_json: the text of tokenizer.json.
        chat_template: Jinja source, or ``None``.
        bos_token, eos_token: token text from tokenizer_config.json, or ``None``.
        bos_token_id: from generation_config.json / config.json, or ``None``.
        eos_token_ids: from generation_config.json, else config.json (may be empty).
        add_bos_token: tokenizer_config.json's flag, ``None`` when it does not say.
    """

    tokenizer_json: str
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos_token: bool | None = None


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ModelFormatError: the file is not valid UTF-8 JSON or not an object.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _optional_json(path: Path) -> dict[str, Any]:
    return load_json(path) if path.is_file() else {}


def read_hf_tokenizer_files(directory: Path) -> HFTokenizerFiles:
    """Collect the tokenizer facts of a Hugging Face model directory.

    Raises:
        FileNotFoundError: no tokenizer.json in ``directory``.
        ModelFormatError: invalid JSON, or a tokenizer that is not byte-level BPE.
    """
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise FileNotFoundError(2, "tokenizer.json not found", str(tokenizer_path))
    text = tokenizer_path.read_text(encoding="utf-8")
    _check_byte_level(load_json(tokenizer_path), tokenizer_path)
    tok_config = _optional_json(directory / "tokenizer_config.json")
    gen_config = _optional_json(directory / "generation_config.json")
    config = _optional_json(directory / "config.json")
    template_file = directory / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else _pick_template(tok_config.get("chat_template")))
    eos_ids = gen_config.get("eos_token_id", config.get("eos_token_id"))
    bos_id = gen_config.get("bos_token_id", config.get("bos_token_id"))
    add_bos = tok_config.get("add_bos_token")
    return HFTokenizerFiles(
        tokenizer_json=text,
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
        bos_token_id=bos_id if isinstance(bos_id, int) else None,
        eos_token_ids=_id_list(eos_ids),
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
    )


def _check_byte_level(spec: dict[str, Any], path: Path) -> None:
    model = (spec.get("model") or {}).get("type")
    decoder = (spec.get("decoder") or {}).get("type")
    if model != "BPE" or decoder != "ByteLevel":
        raise ModelFormatError(
            f"{path}: only byte-level BPE tokenizers are supported "
            f"(model {model!r}, decoder {decoder!r})")


def _pick_template(value: Any) -> str | None:
    # tokenizer_config.json holds a string, or a list of {"name", "template"} (named templates).
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _token_text(value: Any) -> str | None:
    # A token is saved as its text or as an AddedToken object {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
