"""Each job's own augmentation: torchvision's distributions, pure draws, the pixels, and the
same batches per row whatever the order, the other jobs, a resume or a service restart."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from tabloader.catalog._augment import from_torchvision
from tabloader.catalog._errors import OptionError
from tabloader.engine import Loader
from tabloader.engine._prepare.augment import Augmenter, RowStreams
from tabloader.engine.decode import Fit, decode_image

N = 4000  # draws per sample in the statistical tests


def torchvision_rrc(h, w, scale, ratio, generator):
    """torchvision's ``RandomResizedCrop.get_params``, as written there, on torch's RNG."""
    area = h * w
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = math.exp(
            torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item()
        )
        cw = round(math.sqrt(target_area * aspect_ratio))
        ch = round(math.sqrt(target_area / aspect_ratio))
        if 0 < cw <= w and 0 < ch <= h:
            i = torch.randint(0, h - ch + 1, size=(1,), generator=generator).item()
            j = torch.randint(0, w - cw + 1, size=(1,), generator=generator).item()
            return i, j, ch, cw
    in_ratio = w / h
    if in_ratio < min(ratio):
        cw, ch = w, round(w / min(ratio))
    elif in_ratio > max(ratio):
        ch, cw = h, round(h * max(ratio))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def ks(a, b):
    """The two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return np.abs(
        np.searchsorted(a, grid, side="right") / a.size
        - np.searchsorted(b, grid, side="right") / b.size
    ).max()


KS_CRIT = 1.95 * math.sqrt(2 / N)  # alpha = 0.001 for two samples of N


def features(params, h, w):
    """Per crop: area fraction, log aspect, relative top and left."""
    p = np.asarray(params, float)
    i, j, ch, cw = p.T
    return [ch * cw / (h * w), np.log(cw / ch), i / h, j / w]


@pytest.mark.parametrize(
    ("h", "w", "scale", "ratio"),
    [(375, 500, (0.08, 1.0), (3 / 4, 4 / 3)), (120, 200, (0.3, 1.0), (0.5, 2.0))],
)
def test_crop_parameters_follow_torchvisions_distribution(h, w, scale, ratio):
    aug = Augmenter(f"RandomResizedCrop(16, scale={scale}, ratio={ratio})", seed=7)
    ours = [aug.draw((h, w), epoch=0, row_id=r)[0] for r in range(N)]
    gen = torch.Generator().manual_seed(11)
    theirs = [torchvision_rrc(h, w, scale, ratio, gen) for _ in range(N)]
    for a, b in zip(features(ours, h, w), features(theirs, h, w), strict=True):
        assert ks(a, b) < KS_CRIT
    # the test has power: a sampler drawing the aspect ratio uniformly (not log-uniformly),
    # or the area from a narrower range, is told apart
    narrower = (scale[0] + (1 - scale[0]) / 4, 1.0)
    wrong = Augmenter(f"RandomResizedCrop(16, scale={narrower}, ratio={ratio})", 7)
    bad = [wrong.draw((h, w), epoch=0, row_id=r)[0] for r in range(N)]
    assert ks(features(bad, h, w)[0], features(theirs, h, w)[0]) > KS_CRIT


def test_the_ten_tries_fall_back_to_a_center_crop_of_the_nearest_ratio():
    aug = Augmenter("RandomResizedCrop(8, scale=(0.99, 1.0), ratio=(3.0, 4.0))", seed=1)
    # a 100x100 image cannot hold a 3:1 crop of 99% of its area: the fallback, each time
    assert {tuple(aug.draw((100, 100), 0, r)[0]) for r in range(50)} == {(33, 0, 33, 100)}


def test_flips_are_bernoulli_p():
    aug = Augmenter("CenterCrop(4), RandomHorizontalFlip(0.3)", seed=3)
    flips = sum(aug.draw((8, 8), epoch=1, row_id=r)[1] for r in range(N))
    assert abs(flips - 0.3 * N) < 4 * math.sqrt(N * 0.3 * 0.7)


def test_draws_are_a_pure_function_of_seed_epoch_and_row():
    aug = Augmenter("RandomResizedCrop(16), RandomHorizontalFlip()", seed=5)
    again = Augmenter(aug.spec.text, seed=5)
    base = [aug.draw((90, 120), 0, r) for r in range(200)]
    assert base == [again.draw((90, 120), 0, r) for r in range(200)]
    assert base == [aug.draw((90, 120), 0, r) for r in reversed(range(200))][::-1]
    other_epoch = [aug.draw((90, 120), 1, r) for r in range(200)]
    other_seed = [Augmenter(aug.spec.text, seed=6).draw((90, 120), 0, r) for r in range(200)]
    assert sum(a == b for a, b in zip(base, other_epoch, strict=True)) < 5
    assert sum(a == b for a, b in zip(base, other_seed, strict=True)) < 5


@pytest.mark.parametrize("seed", [0, 5, 2**32 + 1, 2**64 + 3])
def test_each_rows_stream_is_philox_keyed_by_the_seed_and_counted_by_epoch_and_row(seed):
    """The reused per-thread generator, repositioned per row, is the stream of a fresh
    ``Philox(key=seed, counter=[0, 0, row, epoch])``, whatever the row before it drew
    (integers leave half a 64-bit word buffered)."""
    streams = RowStreams(seed)  # an Augmenter's, as Augmenter(spec, seed) makes it

    def some(rng):
        return [rng.integers(0, 1000, 3).tolist(), rng.random(2).tolist(), rng.uniform(1, 2)]

    for epoch, row in [(0, 0), (0, 1), (3, 2**40 + 7), (2**31, 5), (0, 1)]:
        ours = some(streams.generator(epoch, row))
        theirs = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, row, epoch]))
        assert ours == some(theirs)


def test_draws_in_threads_equal_draws_in_one_thread():
    from concurrent.futures import ThreadPoolExecutor

    aug = Augmenter("RandomResizedCrop(16), RandomHorizontalFlip(), RandomCrop(12)", seed=9)
    want = [aug.draw((90, 120), 1, r) for r in range(400)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: aug.draw((90, 120), 1, r), range(400)))
    assert got == want


def gradient(h, w):
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x % 256, y % 256, (x + y) % 256], axis=-1).astype(np.uint8)
    img.flags.writeable = False
    return img


def test_center_crop_resize_and_pad_are_torchvisions():
    src = gradient(30, 41)
    out = np.empty((10, 12, 3), np.uint8)
    Augmenter("CenterCrop((10, 12))", 0).apply(src, 0, 0, out)
    top, left = round((30 - 10) / 2), round((41 - 12) / 2)
    assert (out == src[top : top + 10, left : left + 12]).all()
    big = np.empty((34, 41, 3), np.uint8)  # larger than the image: zero-padded, split evenly
    Augmenter("CenterCrop((34, 41))", 0).apply(src, 0, 0, big)
    assert (big[2:32] == src).all()
    assert not big[:2].any()
    assert not big[32:].any()
    resized = Augmenter("Resize(15), CenterCrop((15, 20))", 0)
    assert resized.draw((30, 41), 0, 0) == [None, None]
    out = np.empty((15, 20, 3), np.uint8)
    resized.apply(src, 0, 0, out)  # shorter side 15, the longer int(15 * 41 / 30) = 20
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(src.copy()).permute(2, 0, 1)[None],
        (15, 20),
        mode="bilinear",
        antialias=True,
    )[0].permute(1, 2, 0)
    assert (out == ref.numpy()).all()


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_random_resized_crop_and_flip_are_interpolate_of_the_drawn_box(p):
    """The crop-resize written channels-last (and a flip copied by torch) gives exactly the
    bytes of torch's public ``interpolate`` on the drawn box, flipped when drawn."""
    src = gradient(75, 100)
    aug = Augmenter(f"RandomResizedCrop((24, 32)), RandomHorizontalFlip({p})", seed=3)
    out = np.empty(aug.output_shape, aug.dtype)
    for row in range(20):
        aug.apply(src, 2, row, out)
        (top, left, h, w), flip = aug.draw((75, 100), 2, row)
        assert flip == (p == 1.0)
        box = torch.from_numpy(src[top : top + h, left : left + w].copy()).permute(2, 0, 1)
        ref = torch.nn.functional.interpolate(box[None], (24, 32), mode="bilinear", antialias=True)[
            0
        ].permute(1, 2, 0)
        want = ref.numpy()[:, ::-1] if flip else ref.numpy()
        assert (out == want).all(), row


@pytest.mark.parametrize(
    "spec",
    [
        "RandomResizedCrop((24, 32)), RandomHorizontalFlip()",
        "RandomResizedCrop(20)",
        "RandomResizedCrop(20), RandomHorizontalFlip(), Normalize((0.5, 0.4, 0.3), 0.25)",
        "RandomHorizontalFlip(), Resize(20), CenterCrop(18), RandomHorizontalFlip()",
        "RandomCrop(16, padding=4), RandomHorizontalFlip()",
    ],
)
def test_a_batch_from_the_arena_equals_its_images_one_by_one(spec):
    rng = np.random.default_rng(1)
    images = [
        rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in rng.integers(17, 90, (9, 2))
    ]
    arena = np.concatenate([np.zeros(5, np.uint8), *(im.ravel() for im in images)])
    offsets = 5 + np.cumsum([0] + [im.size for im in images[:-1]])
    shapes = np.array([im.shape[:2] for im in images])
    aug = Augmenter(spec, seed=4)
    batch = np.empty((len(images), *aug.output_shape), aug.dtype)
    aug.apply_batch(arena, offsets, shapes, 3, range(50, 59), batch)
    for k, im in enumerate(images):
        one = np.empty(aug.output_shape, aug.dtype)
        aug.apply(im, 3, 50 + k, one)
        np.testing.assert_array_equal(batch[k], one)
    with pytest.raises(ValueError, match=r"apply_batch: 8 row ids, but offsets \(9,\)"):
        aug.apply_batch(arena, offsets, shapes, 3, range(8), batch)


def test_apply_writes_any_output_layout():
    src = gradient(40, 50)
    aug = Augmenter("RandomResizedCrop((12, 10)), RandomHorizontalFlip(1.0)", seed=2)
    want = np.empty(aug.output_shape, np.uint8)
    aug.apply(src, 0, 3, want)
    wide = np.zeros((12, 10, 4), np.uint8)
    aug.apply(src, 0, 3, wide[:, :, :3])  # pixels 4 bytes apart: not the kernel's layout
    np.testing.assert_array_equal(wide[:, :, :3], want)
    assert not wide[:, :, 3].any()


def test_random_crop_pads_with_fill_and_stays_inside():
    src = np.full((8, 8, 3), 200, np.uint8)
    aug = Augmenter("RandomCrop(8, padding=2, fill=9)", seed=4)
    out = np.empty((8, 8, 3), np.uint8)
    corners = set()
    for r in range(300):
        aug.apply(src, 0, r, out)
        i, j = aug.draw((8, 8), 0, r)[0]
        assert 0 <= i <= 4
        assert 0 <= j <= 4
        corners.add((i, j))
        assert (out == 9).any() == ((i, j) != (2, 2))  # only the unshifted crop has no padding
    assert len(corners) == 25  # every offset of the padded image
    needed = Augmenter("RandomCrop(12, pad_if_needed=True)", 1)
    out = np.empty((12, 12, 3), np.uint8)
    needed.apply(src, 0, 0, out)
    assert (out == 200).sum() == 8 * 8 * 3


def test_flip_and_normalize_write_float_channels_first():
    src = gradient(6, 9)
    aug = Augmenter("CenterCrop((6, 9)), RandomHorizontalFlip(1.0), Normalize((0, 0.5, 1), 0.5)", 0)
    out = np.empty(aug.output_shape, aug.dtype)
    aug.apply(src, 0, 0, out)
    want = (src[:, ::-1].transpose(2, 0, 1) / 255.0 - np.array([0, 0.5, 1])[:, None, None]) / 0.5
    assert out.dtype == np.float32
    assert out.shape == (3, 6, 9)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_from_torchvision_converts_the_supported_ops_and_refuses_others():
    def op(name, **attrs):
        return type(name, (), attrs)()

    compose = types.SimpleNamespace(
        transforms=[
            op("ToImage"),
            op("RandomResizedCrop", size=[224, 224], scale=(0.08, 1.0), ratio=(0.75, 4 / 3)),
            op("RandomHorizontalFlip", p=0.5),
            op("RandomCrop", size=[200], padding=[4], pad_if_needed=False, fill=0),
            op("ToDtype"),
            op("Normalize", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )
    spec = Augmenter(from_torchvision(compose), 0).spec
    assert [o.name for o in spec.ops] == [
        "RandomResizedCrop",
        "RandomHorizontalFlip",
        "RandomCrop",
        "Normalize",
    ]
    assert spec.ops[0].arg("size") == (224, 224)
    assert spec.ops[2].arg("padding") == (4,) * 4
    jitter = types.SimpleNamespace(transforms=[op("ColorJitter")])
    with pytest.raises(OptionError, match=r"torchvision's ColorJitter is not supported; .*Resize"):
        from_torchvision(jitter)


# -- in the engine ---------------------------------------------------------------------------------
TRAIN = "RandomResizedCrop(24, scale=(0.2, 1.0)), RandomHorizontalFlip()"


@pytest.fixture
def jobs(images):
    images.sql(
        f"REGISTER JOB tr SELECT image, label FROM imgs WITH (augment = '{TRAIN}', seed = 1)"
    )
    images.sql(
        f"REGISTER JOB tr2 SELECT image FROM imgs WHERE label < 2 WITH (augment = '{TRAIN}', "
        "seed = 2)"
    )
    images.sql("REGISTER JOB ev SELECT image, label FROM imgs WITH (image_size = 24)")
    return images


def by_row(batches):
    out = {}
    for e, batch in batches:
        for i, img in zip(batch["_id"].tolist(), batch["image"], strict=True):
            out[(e, i)] = np.array(img)
    return out


def epochs_of(loader, job, epochs=2, **kw):
    s = loader.open(job, batch_size=8, epochs=epochs, **kw)
    got = []
    for _ in range(epochs):
        e = s.epoch
        got += [(e, b) for b in s.iter_epoch()]
    s.close()
    return got


@pytest.mark.parametrize("decode", ["threads", "processes"])
def test_each_rows_batch_is_the_augmentation_of_the_shared_decode(jobs, decode):
    """Whatever order the dependent sampler picked and whoever else reads: the value of row r
    in epoch e is ``Augmenter(spec, seed).apply(shared decode of r, e, r)``."""
    ds = jobs.dataset("imgs")
    raw = ds.take(list(range(ds.num_rows)), ["image"]).column("image").to_pylist()
    aug = Augmenter(TRAIN, seed=1)
    with Loader(jobs, decode=decode, cache_bytes=32 << 20) as loader:
        other = loader.open("tr2", batch_size=8, epochs=2)
        got = by_row(epochs_of(loader, "tr"))
        list(other)
        other.close()
        assert loader.stats()["decodes"] == ds.num_rows  # tr2's rows were tr's decodes
    assert len(got) == 2 * ds.num_rows
    for (e, r), img in got.items():
        src = decode_image(raw[r], size=Fit(24))
        want = np.empty((24, 24, 3), np.uint8)
        aug.apply(src, e, r, want)
        assert (img == want).all()
    assert sum((got[(0, r)] != got[(1, r)]).any() for r in range(ds.num_rows)) > ds.num_rows // 2


def test_same_seed_same_batches_per_row_across_runs_orders_and_a_resume(jobs):
    with Loader(jobs, cache_bytes=32 << 20, seed=1) as loader:
        first = by_row(epochs_of(loader, "tr"))
    with Loader(jobs, cache_bytes=32 << 20, seed=99) as loader:  # another sampling order
        s = loader.open("tr", batch_size=8, epochs=2)
        head = [(0, s.take()), (0, s.take())]
        state = s.state_dict()
        s.close()
        resumed = loader.open("tr", batch_size=8, epochs=2, state=state)
        rest = []
        for _ in range(2):
            e = resumed.epoch
            rest += [(e, b) for b in resumed.iter_epoch()]
        resumed.close()
    again = by_row(head + rest)
    assert again.keys() == first.keys()
    assert all((again[k] == first[k]).all() for k in first)
    with Loader(jobs, cache_bytes=32 << 20) as loader:  # another seed: other draws
        other = by_row(epochs_of(loader, "tr", seed=5))
    assert sum((other[k] != first[k]).any() for k in first) > len(first) // 2


def test_an_evaluation_job_shares_the_training_jobs_decodes(jobs):
    ds = jobs.dataset("imgs")
    with Loader(jobs, cache_bytes=32 << 20) as loader:
        tr = loader.open("tr", batch_size=8, epochs=1)
        ev = loader.open("ev", batch_size=8, epochs=1)
        assert sorted(ev.augment) == ["image"]  # Resize + CenterCrop of the shared decode
        images = [b["image"] for b in ev]
        list(tr)
        assert loader.stats()["decodes"] == ds.num_rows
        assert ev.stats()["augment_s"] > 0
        assert tr.stats()["augment_s"] > 0
    assert all(i.shape[1:] == (24, 24, 3) for i in images)


def test_an_image_size_job_alone_keeps_its_fixed_values(images):
    images.sql("REGISTER JOB ev SELECT image FROM imgs WITH (image_size = 24)")
    with Loader(images, cache_bytes=32 << 20) as loader, loader.open("ev", epochs=1) as ev:
        assert dict(ev.augment) == {}
        assert all(b["image"].shape[1:] == (24, 24, 3) for b in ev)


def test_options_given_at_open_are_checked_as_register_checks_them(jobs):
    with Loader(jobs, cache_bytes=32 << 20) as loader:
        with pytest.raises(OptionError, match=r"unknown operation 'Flip'"):
            loader.open("ev", augment="Flip()")
        with pytest.raises(OptionError, match=r"augment makes one batch of 65536 images"):
            loader.open("ev", augment="CenterCrop(512)", batch_size=65536)
        with pytest.raises(OptionError, match=r"augment and image_size are both set"):
            loader.open("tr", image_size=24, augment="CenterCrop(8)")
        with loader.open("tr", image_size=24, batch_size=4) as s:  # replaces the augment
            assert s.take()["image"].shape == (4, 24, 24, 3)
        with pytest.raises(OptionError, match=r"decode_size = 0 is out of range"):
            loader.open("tr", decode_size=0)
        with loader.open("ev", augment="CenterCrop(8)", batch_size=4, epochs=1) as s:
            assert s.take()["image"].shape == (4, 8, 8, 3)


def test_decode_size_caps_the_shared_decode(jobs):
    with Loader(jobs, cache_bytes=32 << 20) as loader:
        s = loader.open("tr", batch_size=8, epochs=1, decode_size=16)
        assert s.take()["image"].shape == (8, 24, 24, 3)  # crops of a 16-pixel decode
        stats = loader.arena.stats()
        s.close()
    # each cached value is the capped decode (about 16 x 21 x 3 bytes, in a size class at most
    # a third larger), not the 90 x 120 x 3 source
    assert 0 < stats.size_bytes / stats.entries <= 16 * 22 * 3 * 4 / 3


def test_augmenting_never_writes_the_shared_values(jobs):
    with Loader(jobs, decode="threads", cache_bytes=32 << 20) as loader:
        list(loader.open("tr", batch_size=8, epochs=1))
        before = loader.arena.buffer.copy()
        s = loader.open("tr2", batch_size=8, epochs=1)
        for b in s:
            b["image"][:] = 0  # the job's own batch
        s.close()
        assert (loader.arena.buffer == before).all()
