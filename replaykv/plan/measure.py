"""Rates of this machine for the loading condition: the image loader's bytes/s and ``torch.mm``'s FLOP/s.

:func:`measure_loader` measures B_IO as this software loads images: read a file from a temporary
directory, decode it and apply the resize plan (:func:`replaykv.images.prepare_image`), on PNG
and JPEG files of generated pictures (:func:`replaykv.pictures.draw_picture`). The files
sit in the page cache, so this is the host's read, decode and preprocess rate in one process,
not a cold disk's. :func:`measure_matmul` measures B_GPU as the best ``torch.mm`` rate over a few
sizes, per dtype. Each runs for about a second by default; the figures are reported, never
asserted on.

Not for: the condition itself (:mod:`replaykv.plan.loading`).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replaykv.model.vision import DeepseekV41VisionConfig


@dataclass(frozen=True)
class LoaderRate:
    """Read + decode + resize plan of stored images, as measured."""

    images: int  # images loaded (files cycled through)
    files: int  # distinct files (one PNG and one JPEG per picture)
    image_size: tuple[int, int] | None  # (width, height) the pictures were stored at (None: as drawn)
    bytes_read: int
    seconds: float
    by_format: dict[str, float]  # bytes/s per format

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    @property
    def mean_image_bytes(self) -> float:
        return self.bytes_read / self.images


def _picture_files(
    directory: Path, pictures: int, image_size: tuple[int, int] | None, seed: int
) -> list[Path]:
    """`pictures` generated pictures written as PNG and as JPEG (quality 90) into `directory`."""
    import numpy as np
    from PIL import Image

    from replaykv.pictures import draw_picture

    rng = np.random.default_rng(seed)
    files = []
    for i in range(pictures):
        img = Image.fromarray(draw_picture(rng).pixels, "RGB")
        if image_size is not None:
            img = img.resize(image_size, Image.Resampling.BICUBIC)
        for fmt, suffix, options in (("PNG", "png", {}), ("JPEG", "jpg", {"quality": 90})):
            path = directory / f"picture{i}.{suffix}"
            img.save(path, format=fmt, **options)
            files.append(path)
    return files


def measure_loader(
    vision: DeepseekV41VisionConfig,
    *,
    image_size: tuple[int, int] | None = None,
    seconds: float = 1.0,
    pictures: int = 4,
    seed: int = 0,
) -> LoaderRate:
    """Bytes/s of reading image files and preparing them for the tower, for about `seconds`.

    Generated pictures (scaled to `image_size` if given) are written as PNG and JPEG into a
    temporary directory, then read back in turn, each decoded and resized by
    :func:`~replaykv.images.prepare_image` under `vision`; every file is loaded at least once.
    """
    from replaykv.images import ImageLimits, prepare_image

    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a measurement needs a positive duration, got {seconds!r} s")
    if pictures < 1:
        raise ValueError(f"the loader needs at least one picture, got {pictures}")
    limits = ImageLimits(max_bytes=2**40, max_pixels=2**40)  # a measurement, not a server
    with tempfile.TemporaryDirectory(prefix="replaykv-loading-") as tmp:
        files = _picture_files(Path(tmp), pictures, image_size, seed)
        prepare_image(files[0].read_bytes(), vision, limits)  # imports and decoders, untimed
        per_format: dict[str, list[float]] = {}
        count = total = 0
        start = time.perf_counter()
        while count < len(files) or time.perf_counter() - start < seconds:
            path = files[count % len(files)]
            t0 = time.perf_counter()
            data = path.read_bytes()
            prepare_image(data, vision, limits)
            tally = per_format.setdefault(path.suffix.lstrip("."), [0.0, 0.0])
            tally[0] += len(data)
            tally[1] += time.perf_counter() - t0
            count += 1
            total += len(data)
        elapsed = time.perf_counter() - start
    return LoaderRate(
        images=count,
        files=len(files),
        image_size=image_size,
        bytes_read=total,
        seconds=elapsed,
        by_format={fmt: b / s for fmt, (b, s) in per_format.items() if s > 0},
    )


@dataclass(frozen=True)
class MatmulRate:
    """The best ``torch.mm`` rate of one dtype over a few square sizes."""

    device: str
    dtype: str
    size: int  # n of the n × n by n × n product that was fastest
    flops_per_second: float
    by_size: dict[int, float] = field(default_factory=dict)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mm_rate(n: int, dtype: Any, device: Any, seconds: float) -> tuple[float, float]:
    """(FLOP/s, seconds of one product) of repeated n × n products for about `seconds`."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    _sync(device)
    one = time.perf_counter() - t0  # first product: warm-up, also sizes the batches
    calls, batch = 0, 1
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            torch.mm(a, b, out=out)
        _sync(device)
        calls += batch
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        batch = min(batch * 2, max(1, calls))
    return 2.0 * n**3 * calls / elapsed, one


def measure_matmul(
    *,
    seconds: float = 1.0,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    sizes: tuple[int, ...] | None = None,
) -> list[MatmulRate]:
    """FLOP/s of ``torch.mm`` per dtype (those the device supports), the best over `sizes`.

    Each dtype gets about `seconds`, split over the sizes; a larger size is skipped once one
    product of the last one took more than a quarter of its share. Default sizes: 128 to 1024
    on a CPU, 1024 to 8192 on an accelerator.
    """
    import torch

    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a measurement needs a positive duration, got {seconds!r} s")
    dev = torch.device(device)
    sizes = sizes or ((128, 256, 512, 1024) if dev.type == "cpu" else (1024, 2048, 4096, 8192))
    share = seconds / len(sizes)
    rates = []
    for name in dtypes:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {name!r}")
        by_size: dict[int, float] = {}
        for n in sizes:
            try:
                rate, one = _mm_rate(n, dtype, dev, share)
            except RuntimeError:  # the dtype has no matmul on this device
                break
            by_size[n] = rate
            if one > share / 4:
                break
        if by_size:
            best = max(by_size, key=lambda n: by_size[n])
            rates.append(MatmulRate(str(dev), name, best, by_size[best], by_size))
    if not rates:
        raise ValueError(f"no dtype of {list(dtypes)} has a matmul on {dev}")
    return rates


@dataclass(frozen=True)
class Measured:
    """Rates measured in one run: the loader's B_IO and the best matmul's B_GPU."""

    loader: LoaderRate
    matmul: list[MatmulRate]
    seconds: float  # the budget each measurement had

    @property
    def best_matmul(self) -> MatmulRate:
        return max(self.matmul, key=lambda r: r.flops_per_second)

    @property
    def io_bandwidth(self) -> float:
        """B_IO: the loader's bytes/s."""
        return self.loader.bytes_per_second

    @property
    def accelerator_flops(self) -> float:
        """B_GPU: the fastest dtype's FLOP/s."""
        return self.best_matmul.flops_per_second


def measure(
    vision: DeepseekV41VisionConfig,
    *,
    image_size: tuple[int, int] | None,
    seconds: float = 1.0,
    device: str = "cpu",
    sizes: tuple[int, ...] | None = None,
) -> Measured:
    """:func:`measure_loader` and :func:`measure_matmul`, each for about `seconds`."""
    loader = measure_loader(vision, image_size=image_size, seconds=seconds)
    return Measured(loader, measure_matmul(seconds=seconds, device=device, sizes=sizes), seconds)
