"""``--model-path`` for every benchmark and lab: one model, resolved once, given to every arm.

    from sglang_kvcmas_bench.model_arg import BenchModel, add_model_arg

    add_model_arg(parser)                      # --model-path (default: the embedded SmolLM2)
    args = parser.parse_args()
    model = model_from_args(parser, args)      # a bad value: parser.error with the reason
    ArmServer(arm, log, [*model.server_args, ...])   # the same model in every arm
    out = model.named(DEFAULT_OUT)             # embedded: DEFAULT_OUT; else DEFAULT_OUT_<slug>

The value is anything the launcher accepts (``models/resolve.py``): ``embedded``, a known short
name (``qwen2.5-coder-0.5b``), a local Hugging Face folder or a ``.gguf`` file. Result files keep
their names for the embedded model and get ``_<slug>`` otherwise, and every record names the
model (:attr:`BenchModel.name`).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from sglang_kvcmas.models.registry import EMBEDDED, KNOWN_MODELS
from sglang_kvcmas.models.resolve import ModelPathError, resolve_model_path
from sglang_kvcmas.server.memory import footprint_of_folder
from sglang_kvcmas.tree.template_markers import TemplateMarkers, derive_markers

__all__ = ["LAB_MODEL_TYPES", "SERVED_DTYPE", "BenchModel", "ModelPathError", "add_model_arg",
           "chat_markers", "model_from_args"]

SERVED_DTYPE = "float32"
"""What our CPU servers run (``server/options.py``: ``--dtype float32`` unless given)."""

LAB_MODEL_TYPES = ("llama", "qwen2")
"""What the lab's reference forward runs (``sglang_kvcmas_lab/models/reference_llama.py``:
Llama; Qwen2 is Llama with q/k/v biases, which the HF projections it calls carry)."""


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--model-path`` (default ``embedded``) to ``parser``."""
    parser.add_argument(
        "--model-path", default=EMBEDDED,
        help=f"the model of every arm: {', '.join(KNOWN_MODELS)}, an HF folder or a .gguf "
             f"(default: {EMBEDDED})")


@dataclass(frozen=True)
class BenchModel:
    """One benchmark's model.

    Attributes:
        arg: the ``--model-path`` value as given (``embedded`` by default).
        folder: the local Hugging Face folder it resolves to.
        name: how results name it: the short name, else the folder's name.
        model_type: ``config.json``'s ``model_type`` (``llama``, ``qwen2``).
        num_layers, num_heads, num_kv_heads, head_dim: the attention shape (``config.json``).
        rope_theta: the RoPE base (``rope_parameters`` or ``rope_theta``; 10000 when absent).
        kv_bytes_per_token: K and V of every layer for one token as our servers hold them
            (layers x KV heads x head_dim x 2 x bytes of ``SERVED_DTYPE``).
    """

    arg: str
    folder: Path
    name: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    kv_bytes_per_token: int

    @classmethod
    def resolve(cls, arg: str | None = None, served_dtype: str = SERVED_DTYPE) -> BenchModel:
        """Resolve ``arg`` (None: the embedded model) once.

        Raises:
            ModelPathError: the launcher's message (unknown name, model not installed, bad path).
        """
        arg = arg or EMBEDDED
        folder = resolve_model_path(arg)
        config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config", config)
        heads = int(text["num_attention_heads"])
        short = arg in KNOWN_MODELS and not Path(arg).expanduser().exists()
        return cls(
            arg=arg if short else str(Path(arg).expanduser().resolve()),
            folder=folder,
            name=arg if short else folder.name,
            model_type=str(config.get("model_type", "?")),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
            rope_theta=float((text.get("rope_parameters") or {}).get("rope_theta")
                             or text.get("rope_theta") or 10000.0),
            kv_bytes_per_token=footprint_of_folder(folder, served_dtype).kv_bytes_per_token,
        )

    @classmethod
    def by_name(cls, arg: str) -> BenchModel:
        """A known model by its short name alone, installed or not: what names its results
        (``name``, ``named``), for summarizing recorded runs; its folder and shape are unknown
        (empty, 0).

        Raises:
            ModelPathError: ``arg`` is not a known short name.
        """
        if arg not in KNOWN_MODELS:
            raise ModelPathError(f"{arg!r} is not a known model ({', '.join(KNOWN_MODELS)})")
        return cls(arg=arg, folder=Path(), name=arg, model_type="?", num_layers=0, num_heads=0,
                   num_kv_heads=0, head_dim=0, rope_theta=0.0, kv_bytes_per_token=0)

    @property
    def is_embedded(self) -> bool:
        return self.arg == EMBEDDED

    @property
    def server_args(self) -> list[str]:
        """The launcher flags that serve this model (the same in every arm)."""
        return ["--model-path", self.arg]

    @property
    def slug(self) -> str:
        """The name in file names: letters, digits and ``-`` only (no dot: ``with_suffix``
        keeps working on a suffixed stem)."""
        return re.sub(r"[^A-Za-z0-9-]+", "-", self.name).strip("-").lower() or "model"

    def named(self, path: Path) -> Path:
        """``path`` itself for the embedded model (committed results keep their names), else
        with ``_<slug>`` after its stem: ``results/x.json`` -> ``results/x_<slug>.json``."""
        if self.is_embedded:
            return path
        return path.with_name(f"{path.stem}_{self.slug}{path.suffix}")

    def out_or_named(self, given: Path | None, default: Path) -> Path:
        """An ``--out`` value: what the user gave, else ``named(default)``. A value equal to
        the default counts as not given (argparse defaults are filled in before we see them)."""
        return self.named(default) if given is None or Path(given) == Path(default) else Path(given)

    def tokenizer(self):
        """The model's tokenizer (``transformers.AutoTokenizer``)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.folder))

    def require_lab_support(self, tok=None) -> None:
        """Refuse a model the labs do not run: the reference forward runs ``LAB_MODEL_TYPES``,
        and the lab workloads write ChatML (``<|im_start|>``) themselves (checked on ``tok``,
        the model's tokenizer, when given).

        Raises:
            ModelPathError: naming what the model lacks.
        """
        if self.model_type not in LAB_MODEL_TYPES:
            raise ModelPathError(
                f"{self.name} is a {self.model_type!r} model; the lab's reference forward runs "
                f"{', '.join(LAB_MODEL_TYPES)} only")
        if tok is not None and not {"<|im_start|>", "<|im_end|>"} <= set(tok.get_vocab()):
            raise ModelPathError(
                f"{self.name}'s tokenizer has no ChatML tokens (<|im_start|>, <|im_end|>); the "
                "lab workloads are written in ChatML")

    def require_embedded(self, why: str) -> None:
        """Refuse any model but the embedded one (``why``: what ties the benchmark to it).

        Raises:
            ModelPathError
        """
        if not self.is_embedded:
            raise ModelPathError(f"{self.name}: {why}; run it with --model-path {EMBEDDED}")


def model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                    lab: bool = False, embedded_only: str | None = None) -> BenchModel:
    """``args.model_path`` resolved; a bad value, or a model this benchmark cannot run (``lab``:
    the labs' checks; ``embedded_only``: why only the embedded model fits), ends the program
    through ``parser.error`` with the reason."""
    try:
        model = BenchModel.resolve(args.model_path)
        if embedded_only:
            model.require_embedded(embedded_only)
        if lab:
            model.require_lab_support(model.tokenizer())
    except ModelPathError as e:
        parser.error(f"--model-path: {e}")
    return model


def chat_markers(tok) -> TemplateMarkers:
    """The head markers of ``tok``'s chat template (what the server derives for ``/generate``
    prompts), for benchmarks that split prompts themselves.

    Raises:
        ModelPathError: the template gives no markers (no system turn, no stable split).
    """
    markers = derive_markers(
        lambda msgs, gen: tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False),
        lambda text: list(tok.encode(text, add_special_tokens=False)), "tokenizer")
    if markers is None:
        raise ModelPathError("the model's chat template gives no agent-head markers")
    return markers
