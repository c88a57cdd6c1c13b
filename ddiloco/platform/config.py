"""One validated configuration tree for a run, loaded from YAML or TOML with env overrides.

Env overrides use the prefix ``DDILOCO_`` and ``__`` between levels, e.g.
``DDILOCO_OUTER__LR=0.5`` or ``DDILOCO_LEDGER__URL=postgresql+psycopg://…``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from ddiloco.platform.ids import validate_id
from ddiloco.platform.redact import MASK, mask_tree, redact_url


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every bad field."""


LONGEST_S = 1e7
"""Upper bound of every duration in seconds (~115 days): finite, and far from datetime's overflow."""
MAX_SEED = 2**63 - 1


def _refuse_bool_numbers(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """YAML's ``true`` is no number: pydantic would read it as 1."""
    if isinstance(value, bool) and info.field_name is not None:
        annotation = cls.model_fields[info.field_name].annotation
        if annotation is not bool and bool not in typing.get_args(annotation):
            raise ValueError("expected a number, got a boolean")
    return value


class _Section(BaseModel):
    # No inf or NaN anywhere: every float field is finite.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)

    no_bool_numbers = field_validator("*", mode="before")(classmethod(_refuse_bool_numbers))


class ModelConfig(_Section):
    kind: Literal["gpt", "moe_gpt", "vision", "import", "hf", "torchtitan"] = "gpt"
    """Built-in architecture; ``import`` for any ``package.module:factory``; ``hf`` for a transformers
    causal LM; ``torchtitan`` for torchtitan's Llama 3."""
    import_path: str | None = None
    """``package.module:factory`` returning an ``nn.Module``; required when kind is ``import``."""
    hf_config: dict[str, Any] | None = None
    """kind hf: keyword arguments of ``transformers.AutoConfig.for_model`` (``model_type`` included);
    ``vocab_size`` defaults to model.vocab_size."""
    hf_path: str | None = None
    """kind hf: a ``save_pretrained`` directory (local or any fsspec URL) whose config.json gives the
    architecture (its weights are used only through ``init_from``)."""
    titan_args: dict[str, Any] = Field(default_factory=dict)
    """kind torchtitan: fields of torchtitan's Llama 3 model config (dim, n_layers, n_heads, …)."""
    init_from: str | None = None
    """Path or fsspec URL of an export (model.safetensors) or a save_pretrained directory: version 0
    of every fragment takes these weights instead of the seeded initialisation."""
    n_layer: int = Field(2, ge=1, le=4096)
    d_model: int = Field(128, ge=8, le=1 << 20)
    n_head: int = Field(4, ge=1, le=1 << 16)
    seq_len: int = Field(128, ge=8, le=1 << 24)
    vocab_size: int = Field(256, ge=2, le=1 << 26)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    n_experts: int = Field(4, ge=2, le=1 << 16)
    """Experts per mixture-of-experts MLP (moe_gpt only)."""
    top_k: int = Field(2, ge=1, le=1 << 16)
    aux_loss_coef: float = Field(0.01, ge=0.0, le=1e3)
    """Weight of the router's load-balancing loss (moe_gpt only)."""
    image_size: int = Field(8, ge=4, le=1 << 16)
    n_classes: int = Field(10, ge=2, le=1 << 26)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to an imported factory."""

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.kind == "import" and not self.import_path:
            raise ValueError("model.import_path is required when model.kind is 'import'")
        if self.import_path is not None and ":" not in self.import_path:
            raise ValueError("model.import_path must look like 'package.module:factory'")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if self.top_k > self.n_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be <= model.n_experts ({self.n_experts})")
        if self.kind == "hf" and (self.hf_config is None) == (self.hf_path is None):
            raise ValueError("model.kind 'hf' needs exactly one of model.hf_config and model.hf_path")
        if self.kind == "hf" and self.hf_config is not None:
            if "model_type" not in self.hf_config:
                raise ValueError("model.hf_config needs a model_type (e.g. llama)")
            why = self.hf_mismatch(self.hf_config)
            if why:
                raise ValueError(why)
        return self

    def in_use(self) -> dict[str, Any]:
        """The fields this model kind reads (what ``ddiloco config`` shows); the others are ignored by it."""
        keep = {"kind", "init_from", *_KIND_FIELDS[self.kind]}
        if self.kind == "hf":
            keep.discard("hf_config" if self.hf_config is None else "hf_path")
        return {k: v for k, v in self.model_dump(mode="json").items() if k in keep}

    def hf_mismatch(self, hf: dict[str, Any]) -> str | None:
        """Why a Hugging Face config's vocabulary or context disagrees with this one, or None."""
        vocab = hf.get("vocab_size")
        if vocab is not None and vocab != self.vocab_size:
            return f"model.vocab_size ({self.vocab_size}) differs from the Hugging Face config's vocab_size ({vocab})"
        context = hf.get("max_position_embeddings", hf.get("n_positions"))
        if context is not None and context < self.seq_len:
            return f"model.seq_len ({self.seq_len}) exceeds the Hugging Face config's max_position_embeddings ({context})"
        return None


_GPT_FIELDS = ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "dropout")
_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "gpt": _GPT_FIELDS,
    "moe_gpt": (*_GPT_FIELDS, "n_experts", "top_k", "aux_loss_coef"),
    "vision": ("image_size", "n_classes", "dropout"),
    "import": ("import_path", "kwargs", "seq_len", "vocab_size"),
    "hf": ("hf_config", "hf_path", "seq_len", "vocab_size"),
    "torchtitan": ("titan_args", "seq_len", "vocab_size"),
}
"""The ModelConfig fields each kind reads besides kind and init_from (seq_len and vocab_size: the data's too)."""


class DataConfig(_Section):
    source: Literal["stdlib", "glob", "digits", "tokens", "text", "hf"] = "stdlib"
    """stdlib: the running interpreter's standard-library .py files as bytes; glob: text files
    matched by ``glob`` (local or any fsspec URL); digits: scikit-learn's bundled 8x8 digits;
    tokens: pre-tokenized shards (``manifest`` or ``shards``); text: jsonl / parquet / text files
    (``shards``) and hf: a Hugging Face dataset (``hf_dataset``), both tokenized on the fly with
    ``tokenizer`` (docs/data.md)."""
    glob: str | None = None
    val_every: int = Field(20, ge=2, le=1 << 30)
    """One file in ``val_every`` (chosen by a hash of its name) goes to the fixed validation set;
    for text and hf, the last 1/``val_every`` of the documents."""
    max_bytes: int = Field(8_000_000, ge=10_000, le=1 << 50)
    """Cap on the corpus size read into memory (stdlib and glob only; the other sources stream)."""
    val_batches: int = Field(8, ge=1, le=1 << 30)
    """Fixed validation batches used for every evaluation."""
    manifest: str | None = None
    """tokens: URL of the manifest.json that ``ddiloco data prepare`` wrote."""
    shards: list[str] = Field(default_factory=list)
    """tokens: URLs or globs of .bin / .parquet token shards (without a manifest; the last one is the
    validation shard unless ``val_shard`` names one); text: URLs or globs of .jsonl / .parquet / text files."""
    val_shard: str | None = None
    """tokens without a manifest: the validation shard's URL."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """tokens without a manifest: the element type of .bin shards."""
    tokenizer: str | None = None
    """A tokenizer.json, or a directory holding one or a save_pretrained tokenizer (local or any fsspec URL)."""
    eos: str | None = None
    """text and hf: the token that ends every document; by default the tokenizer's own end-of-text token
    (a save_pretrained directory's ``eos_token``, ``<|endoftext|>`` in a bare tokenizer.json)."""
    hf_dataset: str | None = None
    """hf: a ``save_to_disk`` directory, or a path ``datasets.load_dataset`` reads (local or fsspec)."""
    hf_split: str = "train"
    text_column: str = "text"
    """text and hf: the field holding a document's text (jsonl, parquet, datasets)."""
    tokens_column: str = "tokens"
    """tokens: the column of token-id lists in parquet shards without a manifest."""
    block_tokens: int = Field(1 << 20, ge=1024, le=1 << 40)
    """tokens: the unit of reading and of shuffling — a learner reads one block of this many tokens
    with one ranged read and draws its windows from it in a random order."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "glob" and not self.glob:
            raise ValueError("data.glob is required when data.source is 'glob'")
        if self.source == "tokens" and not (self.manifest or self.shards):
            raise ValueError("data.source 'tokens' needs data.manifest or data.shards")
        if self.source == "tokens" and self.manifest and self.shards:
            raise ValueError("data.manifest and data.shards are exclusive: the manifest lists the shards")
        if self.source == "text" and not self.shards:
            raise ValueError("data.source 'text' needs data.shards (files or globs of .jsonl, .parquet or text)")
        if self.source == "hf" and not self.hf_dataset:
            raise ValueError("data.source 'hf' needs data.hf_dataset")
        if self.source in ("text", "hf") and not self.tokenizer:
            raise ValueError(f"data.source {self.source!r} needs data.tokenizer")
        return self


_K8S_LABEL_KEY = re.compile(r"^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_K8S_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")
_K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")
_SECRET_NAME = re.compile(r"^[a-z][a-z0-9_]{0,99}$")


class Toleration(_Section):
    """A Kubernetes toleration of a job's pod (the fields of core/v1 ``Toleration``)."""

    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        if self.key is not None and not _K8S_LABEL_KEY.match(self.key):
            raise ValueError(f"toleration key {self.key!r} is not a Kubernetes label key")
        if self.value is not None and not _K8S_LABEL_VALUE.match(self.value):
            raise ValueError(f"toleration value {self.value!r} is not a Kubernetes label value")
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        return self


class PodConfig(_Section):
    """Where the flow runs of one role run and what each gets: its deployment's Prefect job variables
    (``ddiloco deploy``; the variables of infra/work-pools/kubernetes.json)."""

    work_pool: str | None = None
    """Prefect work pool: by default ``region-<name>`` for a region's learners, the first region's pool for the
    control plane (synchronizer, evaluator, training-run supervisor, chaos)."""
    work_queue: str | None = None
    """A queue of that pool (a worker can serve one queue); the pool's default queue when unset."""
    image: str | None = None
    """Container image of the jobs: by default ``deploy.gpu_image`` for jobs with GPUs, else ``deploy.cpu_image``."""
    gpus: int | None = Field(None, ge=0, le=1 << 10)
    """``nvidia.com/gpu`` of each job's pod. Learners: by default one per rank (``learners.nproc_per_node``), 0 with
    ``learners.device: cpu``; 0 makes a CPU region. Control plane: 0 by default."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes node labels the pod must land on, e.g. ``{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}``."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pod tolerates, e.g. ``[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]``."""
    shm_size: str | None = None
    """Size limit of the pod's in-memory ``/dev/shm`` (a Kubernetes quantity, e.g. ``16Gi``; it counts against the
    pod's memory). Unset: no limit of its own. NCCL and data-loader workers need more than a container's 64 MiB."""

    @field_validator("work_pool", "work_queue")
    @classmethod
    def _pool(cls, v: str | None) -> str | None:
        if v is not None and not _POOL_NAME.match(v):
            raise ValueError(f"{v!r} is not a work pool or queue name: use letters, digits, '_', '.' or '-'")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not _IMAGE.match(v):
            raise ValueError(f"{v!r} is not an image reference (registry/repository:tag)")
        return v

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _K8S_LABEL_KEY.match(key) or not _K8S_LABEL_VALUE.match(value):
                raise ValueError(f"{key!r}={value!r} is not a Kubernetes node label")
        return v

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str | None) -> str | None:
        if v is not None and not _K8S_QUANTITY.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity such as 16Gi")
        return v


class RegionConfig(_Section):
    name: str
    learners: int = Field(1, ge=0, le=1 << 16)
    speeds: list[float] = Field(default_factory=list)
    """Relative speed of each learner in this region (1.0 = full speed, 0.5 = 2x slower); missing
    entries are 1.0. Used to emulate mixed hardware."""
    storage_url: str | None = None
    """This region's bucket; the run-wide ``storage.url`` when unset."""
    deploy: PodConfig = Field(default_factory=PodConfig)
    """Where this region's learners run and what each learner's pod gets (``ddiloco deploy``)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_id(v, "region")

    @field_validator("speeds")
    @classmethod
    def _speeds(cls, v: list[float]) -> list[float]:
        for s in v:
            if not 0 < s <= 1:
                raise ValueError(f"every speed must be in (0, 1], got {s}")
        return v


class LearnersConfig(_Section):
    regions: list[RegionConfig] = Field(
        default_factory=lambda: [RegionConfig(name="us", learners=2), RegionConfig(name="eu", learners=2, speeds=[1.0, 0.5])]
    )
    batch_size: int = Field(16, ge=1, le=1 << 24)
    heartbeat_s: float = Field(2.0, gt=0, le=LONGEST_S)
    poll_s: float = Field(0.5, gt=0, le=LONGEST_S)
    """How often a learner looks in the ledger for newer global versions."""
    upload_linger_s: float = Field(0.02, ge=0, le=1.0)
    """How long a learner's idle upload thread waits, once a send arrives, for more sends to write and register with it
    in one ledger transaction. A learner whose steps take milliseconds then registers several fragments an exchange
    instead of one, and its link's thread takes the GIL from the training thread that much less often (docs/ddp.md); a
    slower one only registers each send this much later. 0: each at once. Not applied with ``fragments.overlap`` 0."""
    dead_after_s: float = Field(10.0, gt=0, le=LONGEST_S)
    """A learner with no heartbeat for this long is declared dead."""
    startup_grace_s: float = Field(120.0, gt=0, le=LONGEST_S)
    """A supervisor gives a (re)started learner this long to send its first heartbeat."""
    straggler_factor: float = Field(2.0, gt=1, le=1e6)
    """A live learner whose step time exceeds this multiple of the median straggles."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int = Field(1, ge=1, le=1 << 16)
    nproc_per_node: int = Field(1, ge=1, le=1 << 16)
    """Ranks a launcher (``ddiloco learner``, the flows) starts per learner on its machine (torchrun + DDP;
    rank 0 talks to the ledger and store). The learner's schedule, tokens per step and data shards follow
    the ranks its job really has (torchrun's WORLD_SIZE: nodes x ranks per node), not this field."""
    max_world_size: int = Field(1024, ge=1, le=1 << 20)
    """The most ranks any learner of the run may have, over all its nodes. A learner records its world size
    when it registers and a larger one is refused; the synchronizer judges each submission's tokens per step
    against its learner's recorded ranks, never more than this many."""
    save_optimizer_every: int = Field(200, ge=0, le=1 << 40)
    """Inner steps between saves of a learner's AdamW state (a restart resumes it); 0 disables."""
    compile: bool = False
    """torch.compile the model's forward and loss (off by default: on a CPU the compile time is
    rarely won back on small models)."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """``full``: each block of the model (its repeated layers) keeps only its inputs for the backward pass and runs its
    forward again there: about one more forward's compute a step, for activation memory of one block's input per
    block instead of all its intermediates, which is what lets a large replica or a long sequence fit on a GPU.
    ``selective``: a block also keeps the outputs of its matrix products and attention, and runs again only the
    cheap rest (norms, activations, rotations, sums): most of the compute saved, part of the memory.
    Parameter names and everything a learner sends are unchanged; a model with no repeated blocks is refused."""
    log_every: int = Field(100, ge=0, le=1 << 30)
    """Inner steps between two progress lines in a learner's log (step, tokens, loss, tokens/s); 0: none."""
    link_process: bool = False
    """Run a learner's ledger and store I/O in a child process of its own, so that its link's threads do not take the
    GIL from the training thread at each SQL statement and file call (a learner whose steps take milliseconds loses
    most to that; see docs/ddp.md). Off by default until a GPU run measures it."""
    decode_on_device: bool = False
    """A GPU learner decodes the versions it receives on its GPU (on a side stream) instead of in host memory: only the
    compressed bytes are copied up, and no host CPU decodes. It keeps the bases of compact downloads there too, a float32
    copy of the model on rank 0's GPU, so it is for ``ddp`` learners, and in the learner's own process (not with
    ``link_process``, whose child decodes). Off by default until a GPU run measures it."""
    parallelism: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """How a learner's replica is spread over its ranks: ``ddp`` (a whole copy per rank), ``fsdp`` (FSDP2: each
    parameter cut into row shards, one per rank; bf16 compute with fp32 shards and reduction on GPUs) or ``hsdp``
    (shards within groups of ``shard_size`` ranks, the groups replicated). Learners of one run may differ: what
    they send and receive does not depend on it (docs/ddp.md)."""
    shard_size: int | None = Field(None, ge=1, le=1 << 16)
    """hsdp only: ranks per shard group (must divide the learner's world size); default the ranks of one node."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_nproc_per_node" in data:
            raise ValueError("learners.max_nproc_per_node is gone: set learners.max_world_size, the most ranks a learner "
                             "may have over all its nodes")
        return data

    @model_validator(mode="after")
    def _check(self) -> LearnersConfig:
        why = world_size_problem(self.nproc_per_node, self.max_world_size)
        if why:
            raise ValueError(f"learners.nproc_per_node: {why}")
        if self.decode_on_device and self.parallelism != "ddp":
            raise ValueError(f"learners.decode_on_device needs learners.parallelism ddp: with {self.parallelism} rank 0 would "
                             "hold a float32 copy of the whole model on its GPU, which sharding is there to avoid")
        if self.decode_on_device and self.link_process:
            raise ValueError("learners.decode_on_device and learners.link_process both decode received versions (on the "
                             "GPU, in the I/O process): set one of them")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"learners.regions names must be unique, got {names}")
        if not self.regions:
            raise ValueError("learners.regions must list at least one region")
        for r in self.regions:
            if len(r.speeds) > r.learners:
                raise ValueError(f"region {r.name!r} lists {len(r.speeds)} speeds for {r.learners} learners")
            why = pod_gpus_problem(r.deploy.gpus, self.nproc_per_node, self.device)
            if why:
                raise ValueError(f"regions.{r.name}.deploy.gpus: {why}")
        return self

    def pod_gpus(self, region: RegionConfig) -> int:
        """GPUs of each learner pod of ``region``: its ``deploy.gpus``, else one per rank (none with device cpu)."""
        if region.deploy.gpus is not None:
            return region.deploy.gpus
        return 0 if self.device == "cpu" else self.nproc_per_node

    def learner_ids(self) -> list[tuple[str, str, float]]:
        """(learner id, region, relative speed) for every learner, in a stable order."""
        out = []
        for region in self.regions:
            for i in range(region.learners):
                speed = region.speeds[i] if i < len(region.speeds) else 1.0
                out.append((f"{region.name}-{i}", region.name, speed))
        return out

    def resolve(self, learner_id: str) -> tuple[int, str, float]:
        """(index, region, speed) of a learner named here, or a ConfigError listing the known ids."""
        ids = self.learner_ids()
        for i, (lid, region, speed) in enumerate(ids):
            if lid == learner_id:
                return i, region, speed
        known = ", ".join(lid for lid, _, _ in ids)
        raise ConfigError(f"learner {learner_id!r} is not in learners.regions of the config; known learners: {known}")

    @property
    def count(self) -> int:
        return sum(r.learners for r in self.regions)


def pod_gpus_problem(gpus: int | None, nproc_per_node: int, device: str) -> str | None:
    """Why a learner pod with ``gpus`` GPUs cannot hold its ranks (each rank takes GPU ``LOCAL_RANK``), or None."""
    if gpus is None or gpus == nproc_per_node:
        return None
    if gpus == 0:
        return "learners.device is cuda: a learner pod needs GPUs" if device == "cuda" else None
    if device == "cpu":
        return f"learners.device is cpu: the pod's {gpus} GPUs would stay idle (set 0)"
    return (f"{gpus} GPUs for learners.nproc_per_node = {nproc_per_node} ranks: each rank takes one GPU of its own, "
            f"so a learner pod needs {nproc_per_node} (or 0 for a CPU region)")


class InnerOptimizerConfig(_Section):
    lr: float = Field(3e-3, gt=0, le=10)
    """Peak AdamW learning rate of every learner's inner loop (the outer step is not affected)."""
    weight_decay: float = Field(0.1, ge=0, le=1e3)
    """Decoupled weight decay of matrices; norms, biases and embeddings are never decayed."""
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0, le=1 << 40)
    """Linear warm-up from lr/warmup_steps to lr over this many inner steps."""
    schedule: Literal["constant", "cosine", "wsd"] = "constant"
    """After warm-up: constant; cosine decay to min_lr_ratio·lr; or warmup-stable-decay (constant,
    then linear decay to min_lr_ratio·lr over the last decay_fraction). The decay spans one
    learner's share of the run: token_budget / learners tokens."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """WSD only: the share of the schedule spent decaying."""
    grad_clip: float = Field(1.0, gt=0, le=1e9)
    grad_accum_steps: int = Field(1, ge=1, le=1 << 20)
    """Micro-batches of learners.batch_size per inner step (gradients accumulated, one AdamW step)."""


class FragmentsConfig(_Section):
    count: int = Field(24, ge=1, le=1 << 20)
    """P: the number of fragments the parameters are split into (balanced by bytes)."""
    every: int | None = Field(None, ge=1, le=1 << 30)
    """H: inner steps between two sends of the same fragment; defaults to ``count``."""
    overlap: int = Field(2, ge=0, le=1 << 30)
    """tau: inner steps a learner may run past a send before the merged fragment is expected;
    0 makes a learner wait for the merge (the synchronous DiLoCo mode)."""
    adaptive: bool = True
    """Each learner chooses, from what its link delivers (bytes/s of its completed uploads and downloads),
    how often it sends its fragments (every H steps or a multiple, never more often) and their codec
    (``compression.codec`` or a cheaper one), so that its uploads keep pace with its training
    (``learner_worker/cadence.py``). Every choice is recorded with its reason (heartbeats, events). On by
    default: on a link that keeps up it never changes anything (identical runs in docs/quality.md), on a
    thin one it merged more and trained better than a fixed cadence (docs/multiregion.md). False: every
    learner sends every H steps with compression.codec, whatever its link."""
    adaptive_max_periods: int = Field(4, ge=1, le=1 << 10)
    """The longest send period an adaptive learner may choose, in periods H (at most merge.max_periods)."""
    adaptive_min_codec: Literal["none", "bf16", "int8", "int4"] = "int4"
    """The cheapest codec an adaptive learner may use; ``compression.codec`` itself keeps the codec fixed."""

    @property
    def period(self) -> int:
        return self.every or self.count


class QuorumConfig(_Section):
    min_count: int | None = Field(1, ge=1, le=1 << 20)
    """K as a count of submissions."""
    min_fraction: float | None = Field(None, gt=0, le=1)
    """K as a fraction of live learners (rounded up); used instead of min_count when set."""


class GraceConfig(_Section):
    enabled: bool = True
    gamma: float = Field(0.8, gt=0, lt=1)
    """Safety margin on the grace window."""
    min_s: float = Field(0.0, ge=0, le=LONGEST_S)
    max_s: float | None = Field(5.0, ge=0, le=LONGEST_S)
    """Upper bound on the wait; null means unbounded (wait for every live learner)."""
    ema: float = Field(0.2, gt=0, le=1)
    """Smoothing of the step, quorum and sync time moving averages."""

    @model_validator(mode="after")
    def _check(self) -> GraceConfig:
        if self.max_s is not None and self.max_s < self.min_s:
            raise ValueError(f"grace.max_s ({self.max_s}) must be >= grace.min_s ({self.min_s})")
        return self


class MergeConfig(_Section):
    weighting: Literal["tokens", "equal"] = "tokens"
    """tokens: w = c_tokens * (c_tokens / c_steps); equal: every submission counts the same."""
    method: Literal["rda", "mean"] = "rda"
    """rda: radial-directional averaging; mean: plain weighted mean."""
    on_receipt: Literal["overwrite", "blend", "rebase"] = "blend"
    """What a learner does with a new global fragment G: overwrite its own (local <- G), blend with
    it (local <- (1 - alpha) * local + alpha * G), or rebase onto it (local <- G + (local - snapshot),
    snapshot <- G: the progress not yet sent is carried over and still counted; with none, as on a
    first receipt or with overlap 0, exactly overwrite). blend is the default: it beat overwrite in
    every setting of docs/quality.md at M = 4 (most under stragglers and outages), and tied at M = 8.
    rebase, which keeps all of a learner's unsent progress, lost to blend there in 5 of 7 settings,
    by far under stragglers and outages (dense +10.3% / +4.1%, vision +53% / +55% val loss); without
    faults it equals overwrite on the dense model (nothing is unsent when merges arrive); it won only
    on MoE (-0.5%) and at M = 8 (-1.2%, equal to overwrite). Synchronous DiLoCo (the exact
    reduction) overwrites."""
    blend_alpha: float = Field(0.5, gt=0, lt=1)
    participation_scaling: bool = True
    """Scale each merge's outer gradient by included/live learners, so K < M takes about one full
    outer step per round instead of one per merge."""
    max_staleness: int = Field(4, ge=0, le=1 << 30)
    """Submissions based on a version more than this many versions old are rejected."""
    norm_outlier_factor: float = Field(10.0, gt=1, le=1e6)
    """A submission whose norm per inner step exceeds this multiple of the largest one among the
    fragment's recent merges is rejected (why the maximum: ``synchronizer.policy.check_norm``);
    before a fragment has that history, one above what AdamW at ``inner.lr`` can move is."""
    clip_factor: float | None = Field(None, gt=0, le=1e6)
    """Robust option (off: null): scale each learner's update down to at most this multiple of the
    fragment's recent median norm per step (times its steps, up to one send period) before merging,
    so an update under the outlier bar still moves the merge no more than an honest one could."""
    robust: Literal["none", "trimmed_mean", "median", "drop_opposed"] = "none"
    """Robust option beside ``method`` (off: none), one vote per learner so a claimed weight buys
    nothing. trimmed_mean / median: in every coordinate the most extreme learners are dropped by count
    (``trim_fraction`` of them at each end, at least one / all but the middle one or two), the rest
    merged by ``method`` with their token weights, RDA's norm the trimmed mean of the norms.
    drop_opposed: a learner whose update points against the others' (negative mean cosine with them)
    is merged with no weight, at most ``trim_fraction`` of the learners (at least one). A merge of fewer
    than 3 learners cannot be judged so: it merges by ``method`` after ``clip_factor``'s clipping (if
    set), and its record says so. docs/quality.md measures each against a hostile learner."""
    trim_fraction: float = Field(0.25, gt=0, lt=0.5)
    """robust: the share of a merge's learners trimmed at each end of every coordinate (trimmed_mean),
    or the most it may drop (drop_opposed); rounded down, at least one, always fewer than half."""
    max_periods: int = Field(8, ge=1, le=1 << 20)
    """The most send periods (``fragments.every`` steps) that one learner's pending updates of a
    fragment weigh as in a merge: more steps are not rejected (a learner carries the increments of
    failed uploads, and folds sends into one still queued, so a store outage or a slow link makes
    honest updates long), but their weight is that of this many periods, and their norm is judged over at most as many
    steps, so a claim is no lever."""
    plain_mean_fragments: list[str] = Field(default_factory=lambda: ["embed"])
    """Tensors whose name contains one of these are merged with the plain weighted mean, the rest of
    their fragment with ``method`` (the rule is per tensor, despite the key's name)."""


class OuterOptimizerConfig(_Section):
    lr: float = Field(0.5, gt=0, le=10)
    """0.5, not DiLoCo's 0.7: RDA's step is as long as the average learner's outer gradient, longer
    than the plain mean's, and the sweep in docs/quality.md favours 0.5 under asynchrony.
    Synchronous DiLoCo at the paper's settings uses 0.7."""
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    warmup_versions: int = Field(0, ge=0, le=1 << 20)
    """Each fragment's outer lr rises linearly over its first this many outer steps (lr/W, 2·lr/W, …, lr), so
    that the early outer gradients, the largest of the run, are not amplified by the momentum in full. 0: none."""
    momentum_adjust: Literal["none", "async"] = "async"
    """async: a merge whose updates carry more than one send period (k, token-weighted, at most
    ``merge.max_periods``: a link or a stall held them back) steps with ``momentum ** k - s / (1 + s)`` (at least 0),
    s their token-weighted staleness in versions: an update of k periods counts as k outer steps for the momentum's
    memory, and a stale one already carries the momentum that asynchrony adds (Mitliagkas et al., 2016), so a learner
    behind a slow link does not make the outer step overshoot. Updates of one period, the rule wherever links keep up,
    step with ``momentum`` however stale (an increment re-applies nothing). none: every merge steps with ``momentum``
    (benchmarks/async_momentum.py)."""


CODECS = ("none", "bf16", "int8", "int4")
"""The outer-gradient codecs, the most precise (and largest) first."""


def codec_ladder(codec: str, cheapest: str) -> tuple[str, ...]:
    """``codec`` and the cheaper codecs down to ``cheapest`` (just ``codec`` when ``cheapest`` is not cheaper)."""
    a, b = CODECS.index(codec), CODECS.index(cheapest)
    return CODECS[a : max(a, b) + 1]


class CompressionConfig(_Section):
    codec: Literal["none", "bf16", "int8", "int4"] = "int8"
    """What learners upload their outer gradients in."""
    block_size: int = Field(64, ge=8, le=1 << 24)
    download_codec: Literal["none", "bf16", "int8", "int4"] | None = None
    """What global versions are also published in for learners, as the difference from a base every learner
    holds exactly (``platform/compact.py``); ``none``: learners download every version whole, in float32.
    Unset: the upload codec, so downloads cost what uploads do (and float32 uploads keep exact downloads)."""
    download_base_every: int = Field(16, ge=1, le=1 << 20)
    """Versions between two bases of the compact downloads: a learner downloads a full float32 blob only when
    it is new or more than this many versions behind."""

    @model_validator(mode="after")
    def _downloads_follow_uploads(self) -> CompressionConfig:
        if self.download_codec is None:
            self.download_codec = self.codec
        return self


class StorageConfig(_Section):
    url: str = "file://./ddiloco-runs/store"
    """Root of the fragment store: file://, memory://, s3://, gs:// (any fsspec URL)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options of every store of the run, e.g. ``{"client_kwargs": {"endpoint_url": …}}`` for s3://."""
    secrets: dict[str, SecretStr] = Field(default_factory=dict)
    """Credentials added to storage_options (s3fs: key, secret, token); masked wherever the config is
    shown or recorded. Set them through the environment (``DDILOCO_STORAGE__SECRETS__SECRET=…``)."""

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # A secret reaches each child process as DDILOCO_STORAGE__SECRETS__<NAME> (``secret_env``), read back
        # lower-cased and split at '__': any other name would arrive as another key, and the child would refuse its mask.
        for name in v:
            if not _SECRET_NAME.match(name) or "__" in name:
                raise ValueError(f"secret name {name!r} cannot travel as an environment variable to the run's processes: "
                                 "use lower-case letters, digits and single '_' (fsspec's own names, e.g. key, secret, token)")
        return v

    def fsspec_options(self) -> dict[str, Any]:
        """storage_options with the secrets' values, for opening the store."""
        return {**self.storage_options, **{k: secret_value(v) for k, v in self.secrets.items()}}


class LedgerConfig(_Section):
    url: SecretStr = SecretStr("sqlite:///./ddiloco-runs/ledger.db")
    """SQLAlchemy URL: sqlite:///… (embedded) or postgresql+psycopg://… (multi-region). A secret: shown
    and saved with its password masked (pass the real one through ``DDILOCO_LEDGER__URL``)."""

    @field_serializer("url", when_used="json")
    def _masked_url(self, url: SecretStr | str) -> str:
        # model_copy(update=...) does not validate: a copy may hold the URL as a plain string.
        return redact_url(secret_value(url))
    idle_in_transaction_timeout_s: float | None = Field(5.0, gt=0, le=LONGEST_S)
    """PostgreSQL ends a session idle inside a transaction this long, so a frozen process's row
    locks cannot stall the run (null: never). Keep it under learners.dead_after_s."""


class RetentionConfig(_Section):
    keep_last: int = Field(3, ge=1, le=1 << 30)
    """Newest global versions kept per fragment."""
    checkpoint_every: int = Field(50, ge=1, le=1 << 30)
    """Every k-th version is kept as a checkpoint."""
    keep_submission_blobs: bool = False
    """Keep the blobs of decided submissions (for audits); by default they are deleted."""


class SynchronizerConfig(_Section):
    poll_s: float = Field(0.2, gt=0, le=LONGEST_S)
    lease_ttl_s: float = Field(3.0, gt=0, le=LONGEST_S)
    """A lease not renewed for this long can be taken over by a standby."""
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    max_poll_s: float = Field(60.0, gt=0, le=LONGEST_S)
    """A poll (merges included) running longer than this counts as hung: the lease is let go."""
    eval_every_s: float = Field(10.0, gt=0, le=LONGEST_S)
    """How often the evaluator (``ddiloco evaluate``) evaluates the newest published global model."""
    merge_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where merges run: auto is the GPU when torch sees one, else the CPU."""
    shards: int = Field(1, ge=1, le=1024)
    """Synchronizer shards: each holds its own lease over a fixed subset of the fragments (balanced by
    bytes) and merges only those, so N processes share the merge work. Fixed for the life of a run."""


class ChaosEvent(_Section):
    at_s: float = Field(ge=0, le=LONGEST_S)
    """Seconds after the run starts."""
    action: Literal["kill_learner", "restart_learner", "pause_learner", "resume_learner", "slow_learner", "kill_synchronizer"]
    target: str | None = None
    """Learner id for learner actions; the active synchronizer when unset."""
    duration_s: float = Field(0.0, ge=0, le=LONGEST_S)
    """pause_learner / slow_learner: how long; 0 means until a resume_learner event."""
    slowdown: float = Field(2.0, gt=1, le=1e6)
    """slow_learner: the learner runs this many times slower (SIGSTOP/SIGCONT duty cycle)."""


class ChaosConfig(_Section):
    seed: int = Field(0, ge=0, le=MAX_SEED)
    events: list[ChaosEvent] = Field(default_factory=list)
    random_events: int = Field(0, ge=0, le=1 << 20)
    """When no events are listed, draw this many kill / pause / slow events from ``seed``."""


class DeployConfig(_Section):
    """What ``ddiloco deploy`` gives each deployment beyond the regions' own ``deploy`` sections."""

    gpu_image: str = "ddiloco:cuda"
    """Image of jobs with GPUs (the Dockerfile's ``cuda`` target, pushed to your registry)."""
    cpu_image: str = "ddiloco:cpu"
    """Image of jobs without GPUs (the Dockerfile's ``cpu`` target): the control plane and CPU regions."""
    metrics_port: int = Field(9100, ge=1, le=65535)
    """Port of each job's Prometheus ``/metrics`` (``DDILOCO_METRICS_PORT`` in the pod, exposed as port ``metrics``)."""
    control: PodConfig = Field(default_factory=PodConfig)
    """The synchronizer, the evaluator, the training-run supervisor and chaos: a CPU pool or queue by default."""

    @field_validator("gpu_image", "cpu_image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not _IMAGE.match(v):
            raise ValueError(f"{v!r} is not an image reference (registry/repository:tag)")
        return v


class RunConfig(BaseSettings):
    """Everything that defines a run. Saved in the ledger with every run."""

    model_config = SettingsConfigDict(env_prefix="DDILOCO_", env_nested_delimiter="__", extra="forbid", allow_inf_nan=False)

    no_bool_numbers = field_validator("*", mode="before")(classmethod(_refuse_bool_numbers))

    name: str = "demo"
    seed: int = Field(0, ge=0, le=MAX_SEED)
    token_budget: int = Field(2_000_000, ge=1, le=1 << 62)
    """The run ends when the learners together have trained on this many tokens."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    learners: LearnersConfig = Field(default_factory=LearnersConfig)
    inner: InnerOptimizerConfig = Field(default_factory=InnerOptimizerConfig)
    fragments: FragmentsConfig = Field(default_factory=FragmentsConfig)
    quorum: QuorumConfig = Field(default_factory=QuorumConfig)
    grace: GraceConfig = Field(default_factory=GraceConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    outer: OuterOptimizerConfig = Field(default_factory=OuterOptimizerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_id(v, "name")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Env beats the file: an operator overrides one field without editing the config.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _cross_check(self) -> RunConfig:
        """Fields that are fine alone but make a run that cannot work together."""
        learners = self.learners.count
        if learners < 1:
            raise ValueError("learners.regions must hold at least one learner in all")
        if self.quorum.min_fraction is None and (self.quorum.min_count or 1) > learners:
            raise ValueError(f"quorum.min_count ({self.quorum.min_count}) exceeds the {learners} learners: nothing would ever merge")
        if self.learners.dead_after_s <= self.learners.heartbeat_s:
            raise ValueError(
                f"learners.dead_after_s ({self.learners.dead_after_s}) must exceed learners.heartbeat_s "
                f"({self.learners.heartbeat_s}): every learner would always look dead"
            )
        if self.synchronizer.shards > self.fragments.count:
            raise ValueError(
                f"synchronizer.shards ({self.synchronizer.shards}) exceeds fragments.count ({self.fragments.count}): "
                "some shard would hold no fragment"
            )
        if self.fragments.adaptive and self.fragments.adaptive_max_periods > self.merge.max_periods:
            raise ValueError(
                f"fragments.adaptive_max_periods ({self.fragments.adaptive_max_periods}) exceeds merge.max_periods "
                f"({self.merge.max_periods}): an adaptive learner's honest updates would weigh less than they carry"
            )
        if self.fragments.adaptive and self.fragments.adaptive_min_codec not in codec_ladder(
            self.compression.codec, self.fragments.adaptive_min_codec
        ):
            raise ValueError(
                f"fragments.adaptive_min_codec ({self.fragments.adaptive_min_codec}) is more precise than compression.codec "
                f"({self.compression.codec}): name compression.codec or a cheaper codec"
            )
        if self.learners.activation_checkpoint != "none" and self.model.kind == "vision":
            raise ValueError("learners.activation_checkpoint: model.kind vision has no repeated blocks to recompute; "
                             "set it to none")
        if self.synchronizer.lease_ttl_s <= self.synchronizer.poll_s:
            raise ValueError(
                f"synchronizer.lease_ttl_s ({self.synchronizer.lease_ttl_s}) must exceed synchronizer.poll_s "
                f"({self.synchronizer.poll_s}): the lease would lapse between two renewals"
            )
        urls = [("storage.url", self.storage.url)] + [
            (f"learners.regions.{r.name}.storage_url", r.storage_url) for r in self.learners.regions if r.storage_url
        ]
        if self.model.init_from:
            urls.append(("model.init_from", self.model.init_from))
        for where, url in urls:
            why = store_url_problem(url)
            if why:
                raise ValueError(f"{where}: {why}")
        ledger = self.ledger.url
        ledger = secret_value(ledger)
        why = ledger_url_problem(ledger)
        if why:
            raise ValueError(f"ledger.url: {why}")
        idle = self.ledger.idle_in_transaction_timeout_s
        if ledger.startswith("postgresql") and idle is not None and idle > self.learners.dead_after_s:
            raise ValueError(
                f"ledger.idle_in_transaction_timeout_s ({idle}) must not exceed learners.dead_after_s "
                f"({self.learners.dead_after_s}): a frozen process's locks would outlive its verdict"
            )
        return self

    def storage_url_for(self, region: str | None) -> str:
        for r in self.learners.regions:
            if r.name == region and r.storage_url:
                return r.storage_url
        return self.storage.url

    def to_json(self) -> str:
        """The effective config as recorded in the ledger: passwords in URLs are masked."""
        return json.dumps(mask_tree(self.model_dump(mode="json")), sort_keys=True)


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}" if field else message)
    return "invalid configuration:\n  " + "\n  ".join(lines)


# DDILOCO_* variables that are not config overrides (the dashboard's ledger, infra templates, faults, tests).
OTHER_ENV = frozenset({
    "DDILOCO_LEDGER_URL", "DDILOCO_STORAGE_URL", "DDILOCO_WORKDIR", "DDILOCO_FAULTS", "DDILOCO_FAULT_DIR",
    "DDILOCO_DIST_TIMEOUT_S", "DDILOCO_TEST_POSTGRES_URL", "DDILOCO_REQUIRE_POSTGRES", "DDILOCO_REQUIRE_BROWSER",
    "DDILOCO_REQUIRE_PROMTOOL", "DDILOCO_SAVE_SCREENSHOT", "DDILOCO_METRICS_PORT", "DDILOCO_TENSORBOARD_DIR", "DDILOCO_TRACKING_EVERY_S",
})


def unknown_env(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """One line per ``DDILOCO_*`` variable that overrides no config field (a typo would be ignored silently)."""
    problems = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if not upper.startswith("DDILOCO_") or upper in OTHER_ENV:
            continue
        model: Any = RunConfig
        for part in upper.removeprefix("DDILOCO_").lower().split("__"):
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                if dict in (typing.get_origin(model), *map(typing.get_origin, typing.get_args(model))):
                    continue  # below a mapping the keys are data: DDILOCO_STORAGE__SECRETS__SECRET
                break  # below a plain value nothing is a field
            field = model.model_fields.get(part)
            if field is None:
                break
            sections = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type)]
            model = next((a for a in sections if issubclass(a, BaseModel)), field.annotation)
        else:
            continue
        hint = "" if "__" in upper else " (levels are joined by '__', as in DDILOCO_OUTER__LR)"
        problems.append(f"environment variable {name} overrides no config field{hint}")
    return problems


def build_config(data: dict[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """Validate a dict (plus env overrides) into a RunConfig, or raise ConfigError naming the fields."""
    merged = dict(data or {})
    merged.update(overrides)
    _bounded(merged, "the configuration")
    problems = unknown_env()
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    try:
        return RunConfig(**merged)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except SettingsError as err:
        # A DDILOCO_* override that does not parse (broken JSON for a list or a section).
        cause = f": {err.__cause__}" if err.__cause__ else ""
        raise ConfigError(f"invalid configuration: {err}{cause}".splitlines()[0]) from None


MAX_CONFIG_BYTES = 128 << 10
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 100_000
"""A config is at most this big (a file), nested this deep, and this many values once its aliases are expanded
(a 535-byte YAML alias bomb expands to billions), whatever its format. Honest configs are a few KB; PyYAML parses
about 100 KB a second on a loaded 2-core machine, so a megabyte was ten seconds of a process's start."""


def _bounded(data: Any, where: str) -> None:
    """Refuse data nested deeper than MAX_CONFIG_DEPTH or holding more than MAX_CONFIG_NODES values, without recursion
    (TOML's dotted keys and JSON nest without a bracket the YAML pre-check counts; pydantic and json.dumps recurse)."""
    stack, nodes = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_CONFIG_NODES:
            raise ConfigError(f"{where} holds more than {MAX_CONFIG_NODES} values")
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels")
        stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))


class _StrictLoader(yaml.SafeLoader):
    """YAML with string keys only and no key twice in a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            where = f"line {key_node.start_mark.line + 1}"
            if not isinstance(key, str):
                raise ConfigError(f"{where}: key {key!r} is not a string")
            if key in seen:
                raise ConfigError(f"{where}: key {key!r} appears twice in the same mapping")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """Values in ``node`` once every alias is expanded (memoised: linear in the document, not in the expansion)."""
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in open_:
        raise ConfigError(f"line {node.start_mark.line + 1}: an alias refers to itself")
    open_.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo, open_) + _expanded_size(v, memo, open_) for k, v in node.value)
    else:
        size = 1
    open_.discard(id(node))
    if size > MAX_CONFIG_NODES:
        raise ConfigError(f"line {node.start_mark.line + 1}: more than {MAX_CONFIG_NODES} values once its aliases are expanded")
    memo[id(node)] = size
    return size


def _load_yaml(text: str) -> Any:
    depth = 0
    # The event stream is produced without recursion: bound the nesting before anything is built.
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise ConfigError(f"line {event.start_mark.line + 1}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        _expanded_size(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's mapping; anything else is one ConfigError line naming the file (and the line or key)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {p} must end in .yaml, .yml, .toml or .json")
    with p.open("rb") as f:
        # Read, not stat: a /proc file or one still growing reports a size it does not keep to.
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {err.start})") from None
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else _load_yaml(text)
    except ConfigError as err:
        raise ConfigError(f"config file {p}: {err}") from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        # The parser quotes the offending line: a URL in it keeps its password masked.
        raise ConfigError(f"config file {p} does not parse: {redact_url(' '.join(str(err).split()))}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} is nested too deep") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    _bounded(data, f"config file {p}")
    return data


def ledger_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a ledger here (not a database URL, an unsupported backend, a driver not
    installed, a SQLite path that is a directory), or None. Cheap: nothing is imported or connected."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        # The value itself is not echoed: a mistyped URL may still hold a password.
        return "not a database URL: use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
    backend, _, driver = scheme.lower().partition("+")
    modules = {"sqlite": {"": "sqlite3", "pysqlite": "sqlite3"},
               "postgresql": {"": "psycopg2", "psycopg": "psycopg", "psycopg2": "psycopg2", "pg8000": "pg8000"}}
    if backend not in modules:
        return f"unsupported ledger backend {scheme!r}: use sqlite:/// or postgresql+psycopg://"
    module = modules[backend].get(driver)
    if module is None:
        return f"unsupported driver {driver!r} for {backend}: use {', '.join(sorted(d or backend for d in modules[backend]))}"
    if importlib.util.find_spec(module) is None:
        return f"the {backend} driver {module!r} is not installed (try postgresql+psycopg://)"
    if backend == "sqlite":
        path = rest[1:].split("?", 1)[0] if rest.startswith("/") else ""
        if path and not path.startswith("file:") and path != ":memory:":
            return sqlite_file_problem(Path(path))
    return None


SQLITE_NOTADB = 26
"""SQLite's result code for a file that is not a database."""


def sqlite_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold a SQLite ledger (a directory, a device, a file of something else), or None when
    it is a SQLite database, empty, or not there yet (the ledger creates it).

    The file is read through SQLite itself, never opened by hand: closing any descriptor of a database file drops
    every POSIX lock this process holds on it, so a process with open ledger connections that peeked at the header
    would let another process reset the write-ahead log under them (a relaunched learner's registration vanished
    that way). SQLite shares its locks between the connections of one process and defers such closes."""
    import sqlite3

    try:
        if path.is_dir():
            return f"the SQLite path {path} is a directory"
        if not path.exists():
            above = next((p for p in path.parents if p.exists()), None)
            return f"the SQLite path {path} is below {above}, which is a file" if above and not above.is_dir() else None
        if not path.is_file():
            return f"the SQLite path {path} is not a regular file"
    except OSError as err:
        return f"the SQLite path {path} cannot be read: {err.strerror or type(err).__name__}"
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as err:
        if getattr(err, "sqlite_errorcode", None) == SQLITE_NOTADB or "not a database" in str(err):
            return f"the SQLite path {path} is not a SQLite database"
        # Busy or locked: a database in use, which is what a ledger file is.
    return None


def store_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a fragment store here (an unknown protocol, its fsspec package not installed), or None."""
    from fsspec.registry import known_implementations, registry

    for part in url.split("::"):  # chained URLs: simplecache::s3://…
        protocol = part.split("://", 1)[0].lower() if "://" in part else "file"
        if protocol in registry:
            continue
        known = known_implementations.get(protocol)
        if known is None:
            return f"unknown store protocol {protocol!r} (file://, memory://, s3://, gs://, …)"
        module = known["class"].split(".", 1)[0]
        if importlib.util.find_spec(module) is None:
            return f"the {protocol}:// store needs the {module!r} package, which is not installed"
    return None


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> RunConfig:
    """Load a RunConfig from a YAML/TOML file (or defaults), then apply env and keyword overrides."""
    data = read_config_file(path) if path else {}
    return build_config(data, **overrides)


def secret_value(value: SecretStr | str) -> str:
    """A secret's value (``model_copy(update=...)`` does not validate: a copy may hold a secret as a plain string)."""
    return value.get_secret_value() if isinstance(value, SecretStr) else value


SECRET_MASK = str(SecretStr("secret"))
"""What a saved config holds in place of a secret's value (pydantic's mask; a URL's password is masked as ``MASK``)."""


def masked_secret_problem(cfg: RunConfig) -> str | None:
    """Which secret of ``cfg`` holds a mask in place of its value, or None: a saved config loaded without the
    environment that gives its secrets would open the ledger and the store with the mask for a password."""
    try:
        password = urlsplit(secret_value(cfg.ledger.url)).password
    except ValueError:
        password = None
    how = "a saved config holds its secrets masked; pass the real value through the environment"
    if password in (MASK, SECRET_MASK):
        return f"ledger.url holds the mask {password!r} in place of its password ({how}: DDILOCO_LEDGER__URL)"
    for key, value in cfg.storage.secrets.items():
        if secret_value(value) in (MASK, SECRET_MASK):
            return f"storage.secrets.{key} holds the mask {secret_value(value)!r} ({how}: DDILOCO_STORAGE__SECRETS__{key.upper()})"
    return None


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block (child processes started in it inherit them); restore the previous
    values after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def secret_env(cfg: RunConfig) -> dict[str, str]:
    """The config's secrets as the environment variables that override it: how they reach a child process or a rank,
    since a saved config holds them masked."""
    env = {"DDILOCO_LEDGER__URL": secret_value(cfg.ledger.url)}
    for key, value in cfg.storage.secrets.items():
        env[f"DDILOCO_STORAGE__SECRETS__{key.upper()}"] = secret_value(value)
    return env


def world_size_problem(world: int, limit: int) -> str | None:
    """Why a learner of ``world`` ranks may not join a run whose ``learners.max_world_size`` is ``limit``, or None."""
    if world < 1:
        return f"world size {world}: a learner has at least one rank"
    if world > limit:
        return (f"world size {world} is above learners.max_world_size {limit}: raise the limit in the run's config "
                "or launch fewer ranks")
    return None


def tokens_per_step(model: ModelConfig, batch_size: int, world: int = 1) -> int:
    """Target tokens one inner step trains on across ``world`` ranks: a vision batch counts examples
    (one per image), every other model ``seq_len`` per example. (Torch-free, for the dashboard.)"""
    per_example = 1 if model.kind == "vision" else model.seq_len
    return batch_size * per_example * world
