"""Every environment variable sglang-kvcmas reads, declared once.

Each is read when asked for (not at import), so tests can set them with ``monkeypatch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        return self.get().strip().lower() in ("1", "true", "yes", "on")


KVCMAS_CACHE_DIR = EnvVar(
    "KVCMAS_CACHE_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-kvcmas"),
    "Where converted models and other derived artifacts are kept.",
)
KVCMAS_ALLOW_SGL_KERNEL_STANDIN = EnvVar(
    "KVCMAS_ALLOW_SGL_KERNEL_STANDIN",
    "1",
    "Allow the raising sgl_kernel stand-in when no real sgl_kernel is installed (CPU only).",
)

KVCMAS_SGL_KERNEL_STANDIN_LOG = EnvVar(
    "KVCMAS_SGL_KERNEL_STANDIN_LOG",
    "",
    "If set, a file to which the sgl_kernel stand-in appends one line per op call (tests).",
)

ALL = (KVCMAS_CACHE_DIR, KVCMAS_ALLOW_SGL_KERNEL_STANDIN, KVCMAS_SGL_KERNEL_STANDIN_LOG)

# ----- shared-context serving (issue 6) -----
KVCMAS_SHARE_CONTEXT = EnvVar(
    "KVCMAS_SHARE_CONTEXT",
    "0",
    "Opt-in, per deployment: let agents read each other's KV for their common transcript "
    "(shared-context tree). Off: the kvcmas tree cache behaves exactly like SGLang's RadixCache.",
)
KVCMAS_MIN_BORROWED = EnvVar(
    "KVCMAS_MIN_BORROWED",
    "128",
    "Fewest tokens of other agents' KV a reader borrows; a reader that would borrow fewer "
    "computes them exactly (borrowing them saves little and risks a flipped token).",
)
KVCMAS_TURN_ORDER = EnvVar(
    "KVCMAS_TURN_ORDER",
    "leader",
    "Agent-turn ordering policy when several agents' requests over one new shared segment wait "
    "together: 'leader' (one computes it, the others wait and reuse it) or 'fifo' (no waiting).",
)
KVCMAS_TURN_MAX_WAIT_S = EnvVar(
    "KVCMAS_TURN_MAX_WAIT_S",
    "60",
    "Longest a request is held back (counted from when it is first held) waiting for another "
    "agent to compute its shared segment; a safety bound, the leader normally publishes first.",
)
KVCMAS_TURN_MIN_GAIN = EnvVar(
    "KVCMAS_TURN_MIN_GAIN",
    "32",
    "Fewest shared tokens a waiting request must gain from a leader for it to wait.",
)
KVCMAS_CACHE_AGENT_OUTPUTS = EnvVar(
    "KVCMAS_CACHE_AGENT_OUTPUTS",
    "0",
    "With sharing on, keep an agent request's generated tokens in the tree cache after it "
    "finishes (off: only its prompt; outputs re-enter through the shared transcript).",
)
KVCMAS_RECOMPUTE_BOUNDARY = EnvVar(
    "KVCMAS_RECOMPUTE_BOUNDARY",
    "16",
    "With sharing on, a reader recomputes the first N tokens of every span it borrows from "
    "another context, in its own context and in the same forward pass (0: naive reuse).",
)
KVCMAS_RECOMPUTE_MASS_FRACTION = EnvVar(
    "KVCMAS_RECOMPUTE_MASS_FRACTION",
    "0.1",
    "With sharing on, a reader also recomputes this share of its borrowed tokens, those with the "
    "largest attention mass on their owner's head (recorded in the owner's pass).",
)
KVCMAS_LEAF_MASS_FRACTION = EnvVar(
    "KVCMAS_LEAF_MASS_FRACTION",
    "",
    "Share of its borrowed tokens, by owner head mass, a reader keeps as delta leaves after "
    "recomputing them (empty: all it recomputes); the rest of KVCMAS_RECOMPUTE_MASS_FRACTION is "
    "recomputed every turn, so leaf memory stays bounded.",
)
KVCMAS_RECOMPUTE_TAIL = EnvVar(
    "KVCMAS_RECOMPUTE_TAIL",
    "0",
    "Last foreign borrowed tokens (just before the reader's own suffix) a reader recomputes.",
)
KVCMAS_RECOMPUTE_MAX_FRACTION = EnvVar(
    "KVCMAS_RECOMPUTE_MAX_FRACTION",
    "0.5",
    "Cap on the share of a reader's borrowed tokens that KVCMAS_RECOMPUTE_BOUNDARY recomputes.",
)

ALL = ALL + (
    KVCMAS_SHARE_CONTEXT,
    KVCMAS_MIN_BORROWED,
    KVCMAS_TURN_ORDER,
    KVCMAS_TURN_MAX_WAIT_S,
    KVCMAS_TURN_MIN_GAIN,
    KVCMAS_CACHE_AGENT_OUTPUTS,
    KVCMAS_RECOMPUTE_BOUNDARY,
    KVCMAS_RECOMPUTE_MASS_FRACTION,
    KVCMAS_RECOMPUTE_MAX_FRACTION,
    KVCMAS_RECOMPUTE_TAIL,
    KVCMAS_LEAF_MASS_FRACTION,
)

# ----- tests and scripts (read where they are used; declared here so they are listed once) -----
KVCMAS_KERNEL_TESTS_FULL = EnvVar(
    "KVCMAS_KERNEL_TESTS_FULL",
    "0",
    "Kernel tests: run the full cross product of sizes x ranks x GQA x page sizes (slow in the "
    "Triton interpreter; scripts/gpu_check.sh turns it on).",
)
KVCMAS_GPU = EnvVar(
    "KVCMAS_GPU",
    "0",
    "scripts/install.sh: also install the CUDA extras (sglang-kernel, FlashInfer).",
)
KVCMAS_GPU_CHECK_QUICK = EnvVar(
    "KVCMAS_GPU_CHECK_QUICK",
    "1",
    "scripts/gpu_check.sh: the quick benchmark grid (0 for the full one).",
)

ALL = ALL + (KVCMAS_KERNEL_TESTS_FULL, KVCMAS_GPU, KVCMAS_GPU_CHECK_QUICK)
