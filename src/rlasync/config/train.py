"""Settings of a training run: the trainer (``trainer.*``), the algorithm and the schedule (``train.*``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]

DEFAULT_MAX_NEW_TOKENS = 48
"""New tokens one model turn may sample unless told otherwise: ``train.max_new_tokens``'s
default and ``SamplingParams.max_new_tokens``'s (the engines take it from here)."""


class LoraSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """LoRA adapters on the trainer (``trainer.lora.*``, verl's ``lora_rank``/``lora_alpha``/
    ``target_modules``; needs ``rlasync[lora]``, peft): the base model frozen, only the adapters
    trained, so gradients and AdamW's state are the adapters' alone. A weight sync sends the
    adapters alone (``sync``); checkpoints hold the merged model and the adapter in PEFT's format
    (``rlasync.trainer.lora``)."""

    rank: NonNegativeInt = 0
    """The adapters' rank (verl's ``lora_rank``); 0: no LoRA, the whole model trains."""
    alpha: Annotated[int, msgspec.Meta(gt=0)] = 32
    """Their scale is ``alpha / rank`` (verl's ``lora_alpha``)."""
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input while training (0: the step is deterministic)."""
    target_modules: str | list[str] = "all-linear"
    """The layers adapted: module names (``[q_proj, v_proj]``), or ``all-linear`` (every linear
    layer of the transformer blocks, the LM head excepted)."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What a weight sync sends engines: ``adapter``, the adapters' tensors alone (rank 16 on
    SmolLM2-135M: about 3% of the model's bytes), which each engine adds to the base weights it
    started from (the torch engine merges them at the swap, vLLM loads them as a LoRA adapter:
    ``engine.max_lora_rank`` follows ``rank``); or ``merged``, the whole merged model under the
    base model's names, as without LoRA (any engine; SGLang needs it)."""


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The optimiser and the policy loss (``trainer.*``)."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``adamw`` (verl's and AReaL's default), or ``sgd``: plain SGD, no momentum (AReaL's
    ``optimizer.type: sgd``), whose step is exactly ``-lr * (g + weight_decay * w)``, so the
    summed gradient can be read off the weights (the tests compare ranks that way)."""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    """Learning rate (peak, after warm-up). With AdamW on the 0.8M-parameter quickstart model
    1e-3 learned and 2e-3 was unstable (measured on 2 cores)."""
    beta1: float = 0.9
    """AdamW's first-moment decay (``sgd`` has none)."""
    beta2: float = 0.99
    """AdamW's second-moment decay."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay; for ``sgd``, an L2 term added to the gradient."""
    grad_clip: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Gradient norm clipping."""
    warmup_steps: NonNegativeInt = 0
    """Steps over which the learning rate rises linearly to ``lr``; 0: none."""
    cosine: bool = False
    """Cosine decay after warm-up (to ``min_lr_ratio`` of the peak); else constant."""
    min_lr_ratio: Fraction = 0.1
    """Where the cosine decay ends, as a fraction of ``lr``."""
    micro_batch_size: NonNegativeInt = 0
    """Sequences per forward/backward (gradients accumulate over them); 0: the whole batch."""
    micro_batch_tokens: NonNegativeInt = 0
    """Dynamic micro-batches (verl's ``use_dynamic_bsz``/``ppo_max_token_len_per_gpu``): rows
    sorted by length and grouped so a micro-batch, cut to its longest row, holds at most this
    many tokens (``micro_batch_size`` still caps its rows). One long response then no longer
    pads the whole batch to its width. 0: off (rows in order, padded to the batch's widest)."""
    packing: bool = False
    """Padding-free micro-batches (verl's ``use_remove_padding``): a micro-batch's rows without
    their padding, end to end in a few sequences as long as its longest row, each attending only
    to itself (``rlasync.trainer.packing``). A long-tailed batch (most responses short, a few
    long) then trains as a fraction of its rows; the same logprobs and gradients up to rounding.
    Needs a transformers model whose attention takes packed position ids (Llama, Qwen2 and
    most others; flash-attention on GPU)."""
    lora: LoraSettings = LoraSettings()
    """LoRA adapters instead of training the whole model (``rank`` above 0 turns them on)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing per transformer block (verl's
    ``actor_rollout_ref.model.enable_gradient_checkpointing``): a block keeps only its input for
    the backward and recomputes the rest then, so training memory no longer grows with the layers
    times the tokens, for about one more forward's time. The same gradients; works with FSDP2."""
    recompute_mlp_activation: bool = True
    """A gated MLP (``down(act(gate(x)) * up(x))``: Llama, Qwen, Mistral, Gemma) recomputes its
    activation in the backward instead of keeping its output (Liger-Kernel's SwiGLU): one tensor
    of the MLP's width less per layer and token (360 MB for SmolLM2-135M at 2,048 tokens) for one
    elementwise activation more per layer (3-6 % slower steps of the nano model on a CPU core);
    the same gradients bit for bit (``rlasync.trainer.activations``). False: autograd keeps what
    it keeps, for speed where memory is not short."""
    clip_low: Fraction = 0.2
    """PPO's clip range below 1: ratios under ``1 - clip_low`` are clipped."""
    clip_high: Fraction = 0.2
    """PPO's clip range above 1: ratios over ``1 + clip_high`` are clipped (clip-higher: raise it)."""
    dual_clip_c: float | None = None
    """Dual clip for negative advantages (e.g. 3.0); None: off."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become the batch's: every token alike (``token-mean``, DAPO), every
    sequence alike (``seq-mean-token-mean``, the GRPO paper), or by length (``seq-mean-token-sum``)."""
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Weight of a KL(policy || reference) penalty in the loss (verl's ``kl_loss_coef``); the
    reference is a frozen copy of the starting model. 0: no penalty and no reference kept."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Per-token KL estimator (``low_var_kl`` is ``k3``; verl's ``kl_loss_type``)."""
    entropy_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Weight of an entropy bonus (subtracted from the loss); 0: none."""
    log_entropy: bool = True
    """Report the policy's token entropy (``train/entropy``) even without a bonus."""
    threads: NonNegativeInt = 1
    """torch threads of each training rank (0: torch's default). One is as fast as two for the
    tiny models on 2 cores and immune to other processes' load."""
    cpu_affinity: list[int] = []
    """CPU cores the rank processes may run on (``os.sched_setaffinity``); empty: any. E.g.
    keep the trainer off the engine's core on a small machine."""
    world_size: PositiveInt = 1
    """Data-parallel ranks: processes the trainer actor starts and owns, one torch.distributed
    rank each (gloo on CPU, NCCL on GPU); the batch is split between them and their gradients
    summed, so any ``world_size`` takes the same step."""
    balance_batch: bool = True
    """Split a step's rows over the ranks by tokens, not by position (verl's ``balance_batch``):
    the longest row first, each to the rank holding the fewest tokens, so no rank carries much
    more than its share and the others do not wait for it at the gradient all-reduce. The step
    is the same up to float rounding. False: contiguous, nearly equal row ranges."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How ranks hold the model: ``ddp``, a whole copy each and one gradient all-reduce per step;
    ``fsdp2``, parameters, gradients and optimiser state sharded over the ranks (PyTorch FSDP2,
    each transformer block its own unit), for models one device cannot hold. Both take the same
    step; checkpoints are saved whole and load into either."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the ranks train: ``auto`` takes one GPU per rank (after the engines' on the same
    machine) when the machines have enough for every rank, else the CPU for all of them, with a
    warning where GPUs were there but too few; ``cuda`` insists on GPUs."""
    autocast_bf16: bool = True
    """On GPU, run forward and backward under bf16 autocast (weights and AdamW state stay float32)."""
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    """Deadline for the ranks to start, load the model and join their process group."""
    operation_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    """Deadline of one trainer operation (a step, logprobs, a checkpoint save or load) on its
    ranks, and of each collective among them; raise it for big batches. Other actor calls
    have ``runtime.call_timeout_s``."""


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The run (``train.*``): task, model, schedule."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """The schedule: ``sync`` (generate, then train, strictly alternating), ``one_step_off``
    (generating the next batch while training on this one: every update one version old), or
    ``fully_async`` (a rollouter streaming samples through a bounded queue to the trainer;
    ``async_training.*``)."""

    task: str = "reverse"
    """A synthetic task (``reverse``, ``arith``, ``calc``)."""
    preset: str = "nano"
    """Tiny-model size to build and warm-start (``nano``, ``micro``, ``mini``)."""
    model_dir: str = ""
    """Start RL from this Hugging Face causal-LM folder instead of building and warm-starting
    ``preset`` (it must speak the task's format)."""
    seed: int = 0
    """Seeds the data order, the sampling and the warm-start: a run is reproducible from it."""
    steps: PositiveInt = 300
    """Training steps (optimiser steps in sync mode; weight versions in the asynchronous ones)."""
    prompts_per_step: PositiveInt = 16
    """Rows drawn per step, each rolled out ``group_size`` times."""
    group_size: PositiveInt = 8
    """Samples per prompt (GRPO groups)."""
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Sampling temperature of the rollouts; the trainer's logprobs use the same."""
    max_new_tokens: PositiveInt = DEFAULT_MAX_NEW_TOKENS
    """New tokens one model turn may sample (a turn cut there ends with finish reason
    ``length``); the whole response has its own budget, ``agent.response_length``."""
    ignore_eos: bool = False
    """Sample ``max_new_tokens`` in every turn, past the end-of-sequence token (verl's
    ``rollout.ignore_eos``): for benchmarks that need turns of a known length."""
    warmstart_greedy_threshold: Fraction = 0.4
    """The warm-start stops once held-out greedy accuracy reaches this (or sampled accuracy
    ``warmstart_sampled_threshold``): RL then starts from a policy that emits the format but is
    often wrong."""
    warmstart_sampled_threshold: Fraction = 0.15
    """...or once its sampled accuracy (temperature 1) reaches this."""
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    """The advantage estimator (``rlasync.algorithms.advantages``): GRPO's group-relative,
    RLOO's leave-one-out, or REINFORCE++'s batch-normalised."""
    std_normalize: bool = True
    """GRPO: divide each group's centred rewards by their standard deviation (Dr. GRPO: false)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): groups whose rewards are all
    equal (no GRPO signal) are dropped and more prompts are rolled out until the step has
    ``prompts_per_step`` groups with signal, or ``max_gen_batches`` rounds were made (it then
    trains on the groups it has). ``rollout/gen_batches`` and ``rollout/dropped_groups`` say what
    it cost. ``train.mode`` sync or one_step_off (there every round of a batch is generated at
    one weight version), not fully_async."""
    max_gen_batches: PositiveInt = 4
    """Rollout rounds of ``prompts_per_step`` prompts one step may make (``dynamic_sampling``)."""
    overlong_buffer: NonNegativeInt = 0
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``): a response in
    the last this many tokens before ``agent.response_length`` loses reward linearly, up to
    ``overlong_penalty`` at the limit (the trained reward; ``rollout/overlong_penalty`` is its
    mean). 0: off."""
    overlong_penalty: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """The reward a response at ``agent.response_length`` loses (``overlong_buffer``)."""
    validate_every: PositiveInt = 25
    """Score the held-out rows every this many steps (and at step 0 and the last)."""
    val_size: PositiveInt = 128
    """Held-out problems scored at each validation."""
    val_temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Sampling temperature of validation (verl's ``val_kwargs.temperature``). 0 scores each
    held-out problem's greedy answer; above 0, ``val_samples`` sampled answers each, and
    ``val_accuracy`` is their mean reward (avg@k, the figure DAPO reports): it moves as the
    policy grows sure of right answers, which greedy decoding hides until the most likely
    answer flips."""
    val_samples: PositiveInt = 1
    """Answers sampled per held-out problem (verl's ``val_kwargs.n``); above 1 needs
    ``val_temperature`` above 0 (greedy answers are all the same)."""
    fail_on_reward_errors: NonNegativeInt = 5
    """Within the first this many training batches, a batch whose every reward failed (the
    reward raised, timed out or gave no number) stops the run with ``RewardError``: a broken
    reward shows in seconds, not after hours of training on zeros. 0: never stop.
    ``reward/errors`` in ``metrics.jsonl`` counts failed rewards either way."""
    checkpoint_every: NonNegativeInt = 0
    """Save a checkpoint every this many steps (and after the last); 0: only after the last.
    ``rlasync train … --resume`` continues from the newest one in ``run_dir`` (``--resume=auto``:
    if there is one, else the run starts afresh)."""
    keep_checkpoints: PositiveInt = 2
    """Newest checkpoints kept; older ones are deleted once a newer one is complete."""
    checkpoint_on_interrupt: bool = False
    """On Ctrl-C (SIGINT) or SIGTERM, to the head or to any node of the run (a scheduler signals
    them all at once), finish the step in progress and save a checkpoint before stopping
    (``--resume`` then loses nothing); SIGUSR1 always does. A step that does not finish within
    ``interrupt_grace_s`` is cut, and the run stops without that checkpoint; a second Ctrl-C
    stops at once. Off: an interrupt stops the run at once (within seconds)."""
    interrupt_grace_s: PositiveFloat = 20.0
    """How long an interrupted run may take to finish its step and checkpoint
    (``checkpoint_on_interrupt``); whatever it is doing, the process is gone 5 s after that."""
    run_dir: str = "runs/quickstart"
    """Where the run writes: ``metrics.jsonl``, ``summary.json``, ``checkpoints/``, traces, the warm-start."""
    trace_every: NonNegativeInt = 10
    """Every this many steps, write ``trace_samples`` of the step's trajectories as text (turns,
    tool calls and results, reward, weight versions) to ``<run_dir>/traces.jsonl``; ``rlasync
    show RUN_DIR --step N`` prints them. 0: none."""
    trace_samples: PositiveInt = 2
    """Trajectories traced at each traced step."""
    trackers: list[str] = msgspec.field(default_factory=lambda: ["jsonl"])
    """Where step records, the config and the final summary go: ``jsonl`` (``metrics.jsonl``,
    always kept: ``--resume``, ``rlasync plot`` and ``rlasync show`` read it), ``tensorboard``
    (event files in ``<run_dir>/tensorboard``), ``wandb`` (``WANDB_MODE=offline`` works without
    a network), or one a plugin registered (``rlasync.metrics.trackers.register_tracker``)."""
    wandb_project: str = "rlasync"
    """The W&B project runs are logged to (``trackers: [wandb]``); the run is named after
    ``run_dir``."""

    def __post_init__(self) -> None:
        if self.val_samples > 1 and self.val_temperature == 0:
            raise ValueError(
                f"train.val_samples={self.val_samples} with train.val_temperature=0: greedy answers are all "
                "the same; set train.val_temperature above 0 (e.g. 1.0) or train.val_samples=1"
            )
        if self.dynamic_sampling and self.mode == "fully_async":
            raise ValueError(
                "train.dynamic_sampling runs with train.mode=sync or one_step_off, not fully_async (its queue "
                "admits a fixed number of samples per weight version: async_training.staleness_threshold)"
            )
