"""The model package contract: what export writes, quantize rewrites and the runtime reads.

A package is a folder: the ONNX model, `edgelm.json` (the manifest below, with the sha256 of every
file), `genai_config.json` (the same facts in onnxruntime-genai's words, so genai runs the folder as
it is), the tokenizer (`tokenizer.json`, and `tokenizer_config.json` for genai's and transformers'
tokenizers) and, for instruct models, the chat template. This module is the one place that
defines those JSON files and the graph's I/O names; everything else goes through it.

The runtime knows no model family: heads, KV heads, head size, context, special tokens, I/O names and
how the graph keeps its cache are all stated here. `architecture.type` only says where a package came from.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields

from .errors import InvalidParameterError, PackageError
from .fields import choice, heads, integer, io_name, optional_id, optional_name, token_list
from .kv_layout import KV_KINDS, KVLayout
from .lora_contract import parse_slots
from .sampling import check_params
from .state_layout import LAYER_STATES, StateLayout

MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "edgelm.json"
MANIFEST_FORMAT = "edgelm-package"
MANIFEST_VERSION = 2  # 2 added architecture.n_kv_head and tokenizer.chat_template; 1 still reads
READABLE_VERSIONS = (1, 2)
GENAI_CONFIG_FILE = "genai_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # special tokens and chat template for transformers and genai
KV_CACHE_KINDS = ("concat", "shared_buffer")
KV_DTYPES = ("float32", "float16")
LOGITS_TO_KEEP = "num_logits_to_keep"  # the fused graph's optional input name (IONames.logits_to_keep)


@dataclass
class IONames:
    """The graph's input and output names; per-layer names hold one %d, the layer index (Optimum and
    onnxruntime-genai use these same names, so packages interoperate)."""

    input_ids: str = "input_ids"  # (B, T) int64
    attention_mask: str = "attention_mask"  # (B, total) int64, 1 = real token
    position_ids: str | None = "position_ids"  # (B, T) int64; None where the graph derives positions itself
    logits: str = "logits"  # (B, T or k, vocab)
    past_key: str = "past_key_values.%d.key"  # (B, n_kv_head, past or capacity, head_dim)
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    # a state layer's (architecture.layer_types): conv (B, *conv_state), recurrent (B, *recurrent_state)
    past_conv: str = "past.%d.conv"
    present_conv: str = "present.%d.conv"
    past_recurrent: str = "past.%d.recurrent"
    present_recurrent: str = "present.%d.recurrent"
    logits_to_keep: str | None = None  # optional scalar input: how many last positions get logits (0 = all)
    # "concat": past in, past + new out (left padding); "shared_buffer": one buffer per cache tensor bound
    # as both past and present, written in place at each row's length (right padding)
    kv_cache: str = "concat"
    kv_dtype: str = "float32"

    def past(self, layer: int) -> tuple[str, str]:
        return self.past_key % layer, self.past_value % layer

    def present(self, layer: int) -> tuple[str, str]:
        return self.present_key % layer, self.present_value % layer

    def past_names(
        self, n_layer: int, layer_types: list[str] | None = None, kv_source: list[int] | None = None
    ) -> list[str]:
        """Every layer's cache inputs in order: key and value, or its states (layer_types and kv_source: the
        architecture's; a layer reading another's cache has none)."""
        return [getattr(self, f"past_{kind}") % i for i, kind in _layer_states(n_layer, layer_types, kv_source)]

    def present_names(
        self, n_layer: int, layer_types: list[str] | None = None, kv_source: list[int] | None = None
    ) -> list[str]:
        return [getattr(self, f"present_{kind}") % i for i, kind in _layer_states(n_layer, layer_types, kv_source)]


def _layer_states(
    n_layer: int, layer_types: list[str] | None, kv_source: list[int] | None = None
) -> list[tuple[int, str]]:
    """(layer, "key" / "value" / "conv" / "recurrent") for every cache tensor, in the graph's order (what each
    layer type keeps: runtime/state_layout.py LAYER_STATES); a layer whose kv_source is another layer keeps none."""
    kinds = layer_types or ["full_attention"] * n_layer
    return [
        (i, state)
        for i, kind in enumerate(kinds)
        if kv_source is None or kv_source[i] == i
        for state in LAYER_STATES[kind]
    ]


@dataclass
class Architecture:
    """What the runtime needs of the network's shape; `details` holds family facts for people (width,
    positions, rope_theta, parameter count), which the runtime never reads. Each kind of state beyond one key and
    value of one shape per layer brings its own record, in its own module with its driver: `states` a hybrid
    model's convolution and recurrent states (runtime/state_layout.py), `kv` KV sharing and per-layer shapes
    (runtime/kv_layout.py). The manifest holds their keys flat, beside the others (to_json, Manifest.parse)."""

    type: str  # where the package came from: "gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma3_text"
    vocab_size: int
    context_length: int  # the most tokens (prompt + generated) the model attends over
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (< n_head: grouped-query attention); the cache holds these
    head_dim: int
    details: dict = field(default_factory=dict)
    genai_type: str | None = None  # onnxruntime-genai's model type (the family's); None in packages before it
    states: StateLayout = field(default_factory=StateLayout)  # hybrid models: which layer keeps what state
    kv: KVLayout = field(default_factory=KVLayout)  # where layers' keys and values differ (Gemma 4)

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a state that folds tokens in (it cannot be cut back to any length)."""
        return self.states.has_state

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer's keys and values."""
        return self.kv.shape(layer, n_kv_head=self.n_kv_head, head_dim=self.head_dim)

    def cache_shape(self, kind: str, batch: int, layer: int = 0, length: int = 0) -> tuple[int, ...]:
        """A cache tensor of one kind ("key", "value", "conv", "recurrent") of `layer` for `batch` rows, keys and
        values `length` positions long."""
        if kind in KV_KINDS:
            heads, head_dim = self.kv_shape(layer)
            return (batch, heads, length, head_dim)
        return (batch, *self.states.shape(kind))

    def cache_layers(self) -> list[tuple[int, str]]:
        """(layer, kind) of every cache tensor, in past_names order."""
        return _layer_states(self.n_layer, self.states.layer_types, self.kv.kv_source)

    def cache_kinds(self) -> list[str]:
        """The kind of every cache tensor, in past_names order."""
        return [kind for _, kind in self.cache_layers()]

    def past_names(self, io: IONames) -> list[str]:
        return io.past_names(self.n_layer, self.states.layer_types, self.kv.kv_source)

    def present_names(self, io: IONames) -> list[str]:
        return io.present_names(self.n_layer, self.states.layer_types, self.kv.kv_source)

    def to_json(self) -> dict:
        """The manifest's architecture object: the fields, then each state record's keys (those it has), flat."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("states", "kv")}
        return copy.deepcopy(data) | self.states.to_json() | self.kv.to_json()


def cache_records(layout: dict) -> dict:
    """Architecture's state records from a flat layout (the manifest's keys: a reference model's state_layout(),
    layer_types, conv_state, kv_source ...): each kind takes its own keys; a key no kind has is refused."""
    names = {record: {f.name for f in fields(record)} for record in (StateLayout, KVLayout)}
    unknown = set(layout) - set().union(*names.values())
    assert not unknown, f"no state kind has the key(s) {sorted(unknown)}"
    states, kv = ({k: v for k, v in layout.items() if k in names[record]} for record in (StateLayout, KVLayout))
    return {"states": StateLayout(**states), "kv": KVLayout(**kv)}


@dataclass
class Tokens:
    file: str | None  # tokenizer.json, or None for a package driven by token ids
    bos_token_id: int | None
    eos_token_ids: list[int]  # any of them ends generation (an instruct model's end-of-turn token included)
    pad_token_id: int
    chat_template: str | None = None  # file name of the Jinja chat template, if the model has one


@dataclass
class Sampling:
    """The sampling a model's authors recommend: the keys of its Hugging Face generation_config.json, as they were
    (absent ones None). Export records them; chat uses them when do_sample is true (runtime/chat_defaults.py)."""

    do_sample: bool | None = None  # Hugging Face samples only when true; otherwise its generate() is greedy
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    # the range of every value is the sampler's own (runtime/sampling.py check_params), at these neutral values
    NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}

    @classmethod
    def parse(cls, data: dict, where: str) -> Sampling:
        """Validate a record (PackageError naming the key); unknown keys are refused, so a typo is not lost."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise PackageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        problem = cls.problem(data)
        if problem:
            raise PackageError(f"{where}: {problem}")
        return cls(**data)

    @classmethod
    def problem(cls, data: dict) -> str | None:
        """What is wrong with one record's values, or None: do_sample a boolean, the rest numbers in the sampler's
        ranges (an int where an int belongs)."""
        if data.get("do_sample") is not None and not isinstance(data["do_sample"], bool):
            return f"do_sample must be true, false or null, got {data['do_sample']!r}"
        for key, value in data.items():
            if key == "do_sample" or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int if key == "top_k" else (int, float)):
                return f"{key} must be {'an integer' if key == 'top_k' else 'a number'} or null, got {value!r}"
            try:
                check_params(**(cls.NEUTRAL | {key: value}))
            except InvalidParameterError as e:
                return str(e)
        return None


@dataclass
class Manifest:
    """edgelm.json. Export builds one, quantize derives one (`derive`), the runtime parses one (`parse`)."""

    architecture: Architecture
    io: IONames
    tokenizer: Tokens
    model_file: str = MODEL_FILE
    precision: str = "fp32"  # "fp32", "int8-dynamic", "int8-static", "int4", "fp16", ...
    recipe: dict = field(default_factory=lambda: {"mode": "fp32"})
    export: dict = field(default_factory=dict)  # opset, graph kind, tool versions
    source: dict = field(default_factory=dict)  # what was exported: checkpoint name and hash
    parity: dict | None = None  # export's ONNX Runtime vs PyTorch check
    evaluation: dict | None = None  # quantize's accuracy report against the fp32 package
    files: dict = field(default_factory=dict)  # name -> {"sha256", "bytes"} for every other file
    created_by: str = ""
    lora: dict | None = None  # LoRA adapters merged at export and run-time slots (runtime/lora_contract.py)
    sampling: Sampling | None = None  # the source's generation_config.json sampling, when it had any

    def to_json(self) -> dict:
        data = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, **asdict(self)}
        data["architecture"] = self.architecture.to_json()
        for key in ("lora", "sampling"):  # packages without them keep the manifest they always had
            if data[key] is None:
                del data[key]
        if self.architecture.states.layer_types is None:  # the state names only in hybrid packages' manifests
            for name in ("past_conv", "present_conv", "past_recurrent", "present_recurrent"):
                del data["io"][name]
        return data

    def derive(self, **changes) -> Manifest:
        """A deep copy with some fields replaced: quantize's manifest from the fp32 one."""
        clone = copy.deepcopy(self)
        for name, value in changes.items():
            setattr(clone, name, value)
        return clone

    @classmethod
    def parse(cls, data: dict, where: str = MANIFEST_FILE) -> Manifest:
        """Validate edgelm.json; every error is a PackageError saying which field is wrong."""
        _check_format(data, where)
        arch, io, tok = data.get("architecture"), data.get("io"), data.get("tokenizer")
        if not all(isinstance(x, dict) for x in (arch, io, tok)):
            raise PackageError(f"{where}: architecture, io and tokenizer must be objects")
        # messages name the object a key is in: "edgelm.json architecture: n_head ..."
        architecture = _parse_architecture(arch, f"{where} architecture")
        tokens = _parse_tokens(tok, f"{where} tokenizer")
        io_names = _parse_io(io, f"{where} io")
        model_file = data.get("model_file")
        if not isinstance(model_file, str) or not model_file:
            raise PackageError(f"{where}: model_file must be a file name, got {model_file!r}")
        objects = _parse_records(data, where)
        parse_slots(objects["lora"], where)  # a malformed slot record fails at load, naming the field
        sampling = objects["sampling"]
        return cls(
            architecture=architecture,
            io=io_names,
            tokenizer=tokens,
            model_file=model_file,
            precision=str(data.get("precision", "fp32")),
            recipe=objects["recipe"] or {},
            export=objects["export"] or {},
            source=objects["source"] or {},
            parity=objects["parity"],
            evaluation=objects["evaluation"],
            files=objects["files"] or {},
            created_by=str(data.get("created_by", "")),
            lora=objects["lora"],
            sampling=Sampling.parse(sampling, f"{where} sampling") if sampling is not None else None,
        )


def _check_format(data: dict, where: str) -> None:
    if data.get("format") != MANIFEST_FORMAT:
        raise PackageError(f"{where}: format is {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS:
        raise PackageError(
            f"{where}: format_version {version!r} is not supported (this runtime reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade edgelm or re-export the package"
        )


def _parse_architecture(arch: dict, where: str) -> Architecture:
    n_head, n_kv_head = heads(arch, where, n_head_key="n_head", n_kv_head_key="n_kv_head")
    return Architecture(
        type=str(arch.get("type", "")),
        vocab_size=integer(arch, "vocab_size", where, minimum=1),
        context_length=integer(arch, "context_length", where, minimum=1),
        n_layer=integer(arch, "n_layer", where, minimum=1),
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=integer(arch, "head_dim", where, minimum=1),
        details=arch.get("details") if isinstance(arch.get("details"), dict) else {},
        genai_type=arch.get("genai_type") if isinstance(arch.get("genai_type"), str) else None,
        states=StateLayout.parse(arch, where),
        kv=KVLayout.parse(arch, where),
    )


def _parse_tokens(tok: dict, where: str) -> Tokens:
    eos = token_list(tok.get("eos_token_ids"), where)
    pad = optional_id(tok.get("pad_token_id"))
    return Tokens(
        file=optional_name(tok, "file", where),
        bos_token_id=optional_id(tok.get("bos_token_id")),
        eos_token_ids=eos,
        pad_token_id=pad if pad is not None else eos[0],
        chat_template=optional_name(tok, "chat_template", where),
    )


def _parse_io(io: dict, where: str) -> IONames:
    names = {f.name: f.default for f in fields(IONames)}
    per_layer = ("past_key", "past_value", "present_key", "present_value", "past_conv", "present_conv",
                 "past_recurrent", "present_recurrent")  # fmt: skip
    optional = ("position_ids", "logits_to_keep")
    return IONames(
        **{
            name: io_name(io, name, default, where, per_layer=name in per_layer, optional=name in optional)
            for name, default in names.items()
            if name not in ("kv_cache", "kv_dtype")
        },
        kv_cache=choice(io, "kv_cache", KV_CACHE_KINDS, where, default="concat"),
        kv_dtype=choice(io, "kv_dtype", KV_DTYPES, where, default="float32"),
    )


def _parse_records(data: dict, where: str) -> dict:
    """The records export and quantize keep for people (recipe, parity, ...): objects or absent."""
    keys = ("recipe", "export", "source", "parity", "evaluation", "files", "lora", "sampling")
    objects = {key: data.get(key) for key in keys}
    for key, value in objects.items():
        if value is not None and not isinstance(value, dict):
            raise PackageError(f"{where}: {key} must be an object, got {type(value).__name__}")
    return objects


# ONNX Runtime's graph optimization level for every package (runtime/session.py; genai_config.json says it to
# onnxruntime-genai). At least "basic": its constant folding computes the MatMulNBits inputs of compact GGUF
# blocks (recipe.storage "compact", export/compact_blocks.py); unfolded, those nodes take ONNX Runtime's
# unprepacked path, far slower and at accuracy level 4 wrong (docs/results.md, "Compact storage").
GRAPH_OPTIMIZATION_LEVEL = "ORT_ENABLE_ALL"


def genai_config(manifest: Manifest) -> dict:
    """genai_config.json for a package, as onnxruntime-genai reads it. The model type is the one the package
    records (its family's genai type, export/families/): the contract holds no family's mapping."""
    arch, tok = manifest.architecture, manifest.tokenizer
    if arch.genai_type is None:
        raise ValueError(
            f"{MANIFEST_FILE} has no architecture.genai_type (a package from before it was recorded); its "
            f"{GENAI_CONFIG_FILE} is the one export wrote then"
        )
    eos = tok.eos_token_ids
    return {
        "model": {
            "type": arch.genai_type,
            "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else eos[0],
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": tok.pad_token_id,
            "context_length": arch.context_length,
            "vocab_size": arch.vocab_size,
            "decoder": _genai_decoder(manifest),
        },
        "search": _genai_search(manifest),
    }


def _genai_decoder(manifest: Manifest) -> dict:
    """model.decoder: the graph's file, shape and I/O names."""
    arch, io = manifest.architecture, manifest.io
    inputs = {"input_ids": io.input_ids, "attention_mask": io.attention_mask}
    if io.position_ids is not None:
        inputs["position_ids"] = io.position_ids
    inputs |= {"past_key_names": io.past_key, "past_value_names": io.past_value}
    outputs = {"logits": io.logits, "present_key_names": io.present_key, "present_value_names": io.present_value}
    states = {kind for _, kind in arch.cache_layers()}
    for kind in ("conv", "recurrent"):
        if kind in states:
            inputs[f"past_{kind}_names"] = getattr(io, f"past_{kind}")
            outputs[f"present_{kind}_names"] = getattr(io, f"present_{kind}")
    hybrid = arch.states.genai_decoder()
    return {
        "filename": manifest.model_file,
        "session_options": {
            "log_id": "onnxruntime-genai",
            "provider_options": [],
            "graph_optimization_level": GRAPH_OPTIMIZATION_LEVEL,
        },
        "head_size": arch.head_dim,
        "hidden_size": arch.details.get("n_embd", arch.n_head * arch.head_dim),
        "num_attention_heads": arch.n_head,
        "num_key_value_heads": arch.n_kv_head,
        "num_hidden_layers": arch.n_layer,
        "inputs": inputs,
        "outputs": outputs,
        **hybrid,
    }


def _genai_search(manifest: Manifest) -> dict:
    """search: greedy defaults, and whether past and present share one buffer."""
    return {
        "do_sample": False,
        "max_length": manifest.architecture.context_length,
        "min_length": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": manifest.io.kv_cache == "shared_buffer",
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_k": 1,
        "top_p": 1.0,
        "early_stopping": True,
        "length_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "diversity_penalty": 0.0,
    }
