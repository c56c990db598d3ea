"""Training setups as users run them: optimizers, precisions, Hugging Face models, checkpointing,
accumulation, reloads — each a frozen `Setup` that `run_setup` trains under a guard.

These are the cells of the clean-run matrix (tests/test_clean_matrix.py on the CPU,
benchmarks/clean_matrix.py on a GPU): a healthy device must end every one with zero confirmed
incidents, and one injected fault per cell must be confirmed at its site and step. Models come from
configs (no weights are downloaded); Hugging Face models need the `transformers` extra.

Shapes (`size`): "tiny" for the CPU (one or two layers, 64–128 wide, 4 × 64 tokens), "small" for a
GPU (two layers, 256 wide, 8 × 128 tokens), "1b-width" for HF Llama at the TinyLlama-1.1B widths
(hidden 2048, 32/4 heads, SwiGLU 5632, vocab 32000; 4 layers, 4 × 512 tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODELS = ("llama", "hf-llama", "hf-qwen2", "hf-gpt2", "hf-bert")
OPTIMIZERS = (
    "adamw-foreach", "adamw-fused", "adamw-forloop", "sgd-momentum",
    "manual-step-then-update",  # guard.step() after backward, then a p.data update (the documented order)
    "manual-update-then-step",  # a p.data update, then guard.step(): weights change before verification
)  # fmt: skip
PRECISIONS = ("fp32", "bf16", "fp16", "autocast-bf16", "autocast-fp16")
SIZES = ("tiny", "small", "1b-width")


@dataclass(frozen=True)
class Setup:
    """One way of training. `fault_site` is where the cell's injected fault goes (a site name)."""

    name: str
    model: str = "llama"
    optimizer: str = "adamw-foreach"
    precision: str = "fp32"
    grad_scaler: bool = False  # torch.amp.GradScaler around the step (fp16 training)
    checkpointing: bool = False  # activation checkpointing of every block
    accumulation: int = 1  # micro-batches per optimizer step
    reload_at: int | None = None  # load_state_dict (model and optimizer) of an earlier snapshot at this step
    fp32_matmul: str | None = None  # torch.set_float32_matmul_precision for the run ("high": TF32)
    fault_site: str = "layers.0.mlp.up_proj:fwd"
    size: str = "tiny"

    def __post_init__(self) -> None:
        for field, allowed in (("model", MODELS), ("optimizer", OPTIMIZERS), ("precision", PRECISIONS),
                               ("size", SIZES)):  # fmt: skip
            if getattr(self, field) not in allowed:
                raise ValueError(f"Setup.{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.accumulation < 1:
            raise ValueError("Setup.accumulation must be >= 1")

    @property
    def manual(self) -> bool:
        return self.optimizer.startswith("manual")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(self.precision)


def _hf_config(model: str, size: str):
    import transformers as tf

    width = {"tiny": 64, "small": 256, "1b-width": 2048}[size]
    layers = {"tiny": 2, "small": 2, "1b-width": 4}[size]
    heads, kv_heads = (32, 4) if size == "1b-width" else (4, 2)
    ffn = 5632 if size == "1b-width" else 2 * width
    vocab = 32000 if size == "1b-width" else 128
    common = {"vocab_size": vocab, "max_position_embeddings": 1024}
    if model == "hf-llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, **common,
        )  # fmt: skip
    if model == "hf-qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, **common,
        )  # fmt: skip
    if model == "hf-gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            n_embd=width, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=1024, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
    return tf.BertForMaskedLM, tf.BertConfig(  # default dropout (0.1) stays on
        hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, **common
    )


def build_model(setup: Setup, device: torch.device) -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor]]:
    """The model on `device` in the setup's weight dtype, and `loss(model, batch)`."""
    if setup.model == "llama":
        from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

        dims = {"tiny": (128, 1, 256), "small": (256, 2, 512), "1b-width": (2048, 4, 5632)}[setup.size]
        width, layers, ffn = dims
        cfg = LlamaConfig(
            vocab_size=128, dim=width, n_layers=layers, n_heads=4, n_kv_heads=2, hidden_dim=ffn, max_seq_len=512,
            activation_checkpointing=setup.checkpointing,
        )  # fmt: skip
        model = Llama(cfg)

        def loss(m: nn.Module, batch) -> torch.Tensor:
            return lm_loss(m(batch[0]), batch[1])
    else:
        cls, cfg = _hf_config(setup.model, setup.size)
        model = cls(cfg)
        if setup.checkpointing:  # the name newer transformers use, else the one older releases have
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()

        def loss(m: nn.Module, batch) -> torch.Tensor:
            return m(input_ids=batch[0], labels=batch[1]).loss

    model.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    return model.to(device=device, dtype=dtype), loss


def build_optimizer(setup: Setup, model: nn.Module) -> torch.optim.Optimizer | None:
    params = list(model.parameters())
    lr = 1e-3
    if setup.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if setup.optimizer == "adamw-foreach":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if setup.optimizer == "adamw-forloop":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if setup.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return None  # a hand-written update


def _batches(setup: Setup, device: torch.device, vocab: int, seed: int):
    batch, seq = {"tiny": (4, 64), "small": (8, 128), "1b-width": (4, 512)}[setup.size]
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(vocab, (batch, seq + 1), generator=generator)
        inputs = tokens[:, :-1].contiguous()
        targets = tokens[:, 1:].contiguous() if setup.model == "llama" else inputs  # HF shifts causal labels itself
        yield inputs.to(device), targets.to(device)


@dataclass
class SetupResult:
    """What a guarded run of one setup did (JSON-ready through `to_dict`)."""

    setup: str
    steps: int
    seconds: float
    summary: dict
    incidents: list[tuple[str, int, int]]  # (site, step, rank)
    verdicts: dict[str, int]  # verdict kind → count
    injected: list[tuple[str, int]]
    relaxations: int  # thresholds that widened after a false alarm and relaxed back
    uncalibrated: list[str]  # checked sites still calibrating at the end
    losses: list[float]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_setup(setup: Setup, config, *, steps: int, device: torch.device | str = "cpu", seed: int = 0) -> SetupResult:
    """Train `setup` for `steps` optimizer steps under a guard built from `config` (a GuardConfig)."""
    import aegis_sdc as aegis

    device = torch.device(device)
    torch.manual_seed(seed)
    model, loss_of = build_model(setup, device)
    optimizer = build_optimizer(setup, model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 128)  # HF models: their config's
    batches = _batches(setup, device, vocab, seed + 1)
    scaler = torch.amp.GradScaler(device.type) if setup.grad_scaler else None
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    verdicts: Counter[str] = Counter()
    guard.subscribe(lambda event, payload: verdicts.update([payload.kind.value]) if event == "verdict" else None)
    saved_precision = torch.get_float32_matmul_precision()
    if setup.fp32_matmul is not None:
        torch.set_float32_matmul_precision(setup.fp32_matmul)
    snapshot = None
    losses = []
    started = time.perf_counter()
    try:
        for step in range(steps):
            if setup.reload_at is not None and step == setup.reload_at // 2:
                optimizer_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
                snapshot = (copy.deepcopy(model.state_dict()), optimizer_state)
            if setup.reload_at is not None and step == setup.reload_at:
                model.load_state_dict(snapshot[0])
                if optimizer is not None:
                    optimizer.load_state_dict(snapshot[1])
            total = 0.0
            for _ in range(setup.accumulation):
                with torch.autocast(device.type, dtype=setup.autocast_dtype or torch.bfloat16,
                                    enabled=setup.autocast_dtype is not None):  # fmt: skip
                    loss = loss_of(model, next(batches)) / setup.accumulation
                (scaler.scale(loss) if scaler is not None else loss).backward()
                total += float(loss.detach())
            losses.append(total)
            _update(setup, model, optimizer, scaler, guard)
        summary = guard.close()
    finally:
        if setup.fp32_matmul is not None:
            torch.set_float32_matmul_precision(saved_precision)
        if not guard.closed:
            guard.close()
    thresholds = [s.row for s in guard.sensors] + [s.col for s in guard.sensors if s.col_check]
    thresholds += [
        state for sensor in guard.attention_sensors.values() for states in sensor.states.values() for state in states
    ]
    return SetupResult(
        setup=setup.name,
        steps=steps,
        seconds=time.perf_counter() - started,
        summary=summary.to_dict(),
        incidents=[(i.site.name, i.step, i.identity.rank) for i in guard.incidents],
        verdicts=dict(verdicts),
        injected=[(j.site, j.step) for j in guard.injector.log],
        relaxations=sum(t.relaxations for t in thresholds),
        uncalibrated=[s.site.name for s in guard.sensors if s.row.calibrating and s.row.samples],
        losses=losses,
    )


def _update(setup: Setup, model: nn.Module, optimizer, scaler, guard) -> None:
    """One optimizer step the way the setup's users write it."""
    if optimizer is not None:
        if scaler is not None:
            scaler.step(optimizer)  # skipped (and so is the guard's step end) when gradients overflowed
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    if setup.optimizer == "manual-step-then-update":
        guard.step()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-0.05)  # p.data: the update bumps no version counter
                p.grad = None
    if setup.optimizer == "manual-update-then-step":
        guard.step()


def _site(model: str, kind: str) -> str:
    """A mid-model Linear of each architecture, as the guard names its sites."""
    module = {
        "llama": "layers.0.mlp.up_proj",
        "hf-llama": "model.layers.0.mlp.up_proj",
        "hf-qwen2": "model.layers.0.mlp.up_proj",
        "hf-gpt2": "lm_head",  # the head (its blocks' Conv1D projections are protected too)
        "hf-bert": "bert.encoder.layer.0.intermediate.dense",
    }[model]
    return f"{module}:{kind}"


def matrix(size: str = "tiny") -> tuple[Setup, ...]:
    """The clean-run matrix: every common way of training, each with a site for its injected fault
    (forward, dgrad and wgrad in turn)."""
    cells = [
        ("adamw-fused", {"optimizer": "adamw-fused"}, "fwd"),
        ("adamw-foreach", {"optimizer": "adamw-foreach"}, "dgrad"),
        ("adamw-forloop", {"optimizer": "adamw-forloop"}, "wgrad"),
        ("sgd-momentum", {"optimizer": "sgd-momentum"}, "fwd"),
        ("manual-step-then-update", {"optimizer": "manual-step-then-update"}, "fwd"),
        # weights change before the step is verified: replays that reference a weight cannot be
        # judged (not_verifiable), so this cell's fault goes where the capture copies its operands
        ("manual-update-then-step", {"optimizer": "manual-update-then-step"}, "wgrad"),
        ("autocast-fp16-gradscaler", {"precision": "autocast-fp16", "grad_scaler": True}, "dgrad"),
        ("bf16-weights", {"precision": "bf16", "optimizer": "adamw-fused"}, "fwd"),
        ("autocast-bf16", {"precision": "autocast-bf16", "optimizer": "adamw-fused"}, "wgrad"),
        ("fp32-matmul-high", {"fp32_matmul": "high"}, "fwd"),  # TF32 / bf16 allowed for the user's fp32 GEMMs
        ("activation-checkpointing", {"checkpointing": True}, "dgrad"),
        ("accumulation-4", {"accumulation": 4}, "wgrad"),
        ("load-state-dict", {"reload_at": 24, "optimizer": "adamw-fused"}, "fwd"),
        ("hf-llama-gqa", {"model": "hf-llama", "precision": "autocast-bf16", "optimizer": "adamw-fused"}, "fwd"),
        ("hf-qwen2", {"model": "hf-qwen2", "precision": "bf16"}, "dgrad"),
        ("hf-gpt2", {"model": "hf-gpt2", "optimizer": "adamw-fused"}, "wgrad"),
        ("hf-bert-dropout", {"model": "hf-bert"}, "wgrad"),
        ("hf-llama-checkpointing", {"model": "hf-llama", "checkpointing": True}, "dgrad"),
    ]
    setups = [
        Setup(name, size=size, fault_site=_site(options.get("model", "llama"), kind), **options)
        for name, options, kind in cells
    ]
    if size != "tiny":
        wide = Setup(
            "hf-llama-1b-width-fused-bf16", model="hf-llama", precision="bf16", optimizer="adamw-fused",
            size="1b-width", fault_site=_site("hf-llama", "fwd"),
        )  # fmt: skip
        setups.append(wide)
    return tuple(setups)
