"""Time one image through a randomly initialised vision tower of a released shape.

--family gemma3: SigLIP-So400m as Gemma 3 4B/12B/27B ship it (896 px, patches of 14: 4096 patches, 27 layers
of 1152, 16 heads, MLP 4304), pooled to 256 rows and projected to a hidden size of 2560 (Gemma 3 4B).
--family mistral3: Pixtral as Mistral Small 3.1 ships it (24 layers of 1024, 16 heads, gated MLP 4096,
longest edge 1540), 2x2 merged and projected to 5120; the 1024 x 768 test photo becomes 74 x 56 patches.
--family qwen2_5_vl: Qwen2.5-VL 7B's tower (32 layers of 1280, 16 heads, gated MLP 3420, windows of 112 px but
in blocks 7, 15, 23, 31), 2x2 merged and projected to 3584; the test photo becomes 74 x 54 patches (999 rows).
Weights F16 (as an mmproj-*-f16.gguf holds them). Prints seconds per image (preprocessing, encoder,
projector), the image's rows and the process's peak RSS.

Usage: python3 scripts/bench_vision.py [--family gemma3|mistral3|qwen2_5_vl] [--threads N] [--layers N]
    [--repeat 2]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import cpu  # noqa: E402
from engine.memory import peak_rss_mb  # noqa: E402
from engine.vision.gemma3 import Gemma3Vision, Gemma3VisionShape  # noqa: E402
from engine.vision.pixtral import PixtralShape, PixtralVision  # noqa: E402
from engine.vision.qwen25 import Qwen25Vision, Qwen25VisionShape  # noqa: E402
from engine.vision.siglip import SiglipShape  # noqa: E402
from engine.weights import Weight  # noqa: E402


class RandomWeights:
    """A weight source of random F16 matrices and float32 vectors, one random array per shape."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.cache = {}

    def _array(self, shape, scale):
        key = (shape, scale)
        if key not in self.cache:
            self.cache[key] = (self.rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
        return self.cache[key]

    def has(self, name):
        return True

    def shape(self, name):
        return (1152, 4304) if "ffn_down" in name else (4304, 1152)

    def matrix(self, name, rows, cols):
        raw = self._array((rows, cols), cols**-0.5).view(np.uint8)
        return Weight(1, raw, rows, cols)

    def vector(self, name, n):
        return np.ones(n, np.float32) if "ln" in name or "norm" in name else np.zeros(n, np.float32)

    def floats(self, name, shape):
        return self._array(shape, 0.02).astype(np.float32)

    def floats_any(self, name, *shapes):
        return self.floats(name, shapes[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--family", choices=("gemma3", "mistral3", "qwen2_5_vl"), default="gemma3")
    parser.add_argument("--layers", type=int, default=None, help="encoder layers (default: the release's)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        cpu.set_threads(args.threads)
    from PIL import Image

    if args.family == "gemma3":
        encoder = SiglipShape(hidden=1152, ff=4304, layers=args.layers or 27, heads=16, image_size=896,
                              patch=14)
        shape = Gemma3VisionShape(encoder, text_hidden=2560, pool=4)
        tower = Gemma3Vision(shape, RandomWeights(), Path("random"))
        layers = encoder.layers
    elif args.family == "qwen2_5_vl":
        shape = Qwen25VisionShape(hidden=1280, ff=3420, layers=args.layers or 32, heads=16, patch=14,
                                  text_hidden=3584, positions=0, mrope_section=(16, 24, 24),
                                  mrope_interleaved=False, min_pixels=3136, max_pixels=12845056,
                                  full_blocks=(7, 15, 23, 31))
        tower = Qwen25Vision(shape, RandomWeights(), Path("random"))
        layers = shape.layers
    else:
        shape = PixtralShape(hidden=1024, ff=4096, layers=args.layers or 24, heads=16, patch=14,
                             longest_edge=1540, text_hidden=5120)
        tower = PixtralVision(shape, RandomWeights(), Path("random"))
        layers = shape.layers
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    best = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        pixels = tower.pixels(data)
        t1 = time.perf_counter()
        rows = tower.encode(pixels)
        t2 = time.perf_counter()
        run = {"preprocess_s": round(t1 - t0, 3), "encode_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3)}
        if best is None or run["total_s"] < best["total_s"]:
            best = run
    print(json.dumps({"family": args.family, "layers": layers, "pixels": list(pixels.shape[1:]),
                      "rows": list(rows.shape),
                      "threads": cpu.get_threads(), **best, "peak_rss_mb": round(peak_rss_mb(), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
