"""Can learned matrix values recover a calibration error? (an experiment, not a test)

    .venv/bin/python benchmarks/learned_recovery.py [--steps 400] [--lr 1e-3,1e-4] [--yaw-deg 0.5] [--shift-m 0.05]

1. The TRUE store: the bundled nuScenes rig's ray matrix, ``--topk 24 --align 16`` (uniform depth prior).
2. The WRONG store: the same build from a deliberately wrong calibration: CAM_FRONT yawed by
   ``--yaw-deg`` about the ego z axis and moved ``--shift-m`` in a random horizontal direction (seed 0).
3. Features: smooth random maps (white noise blurred by a separable Gaussian, sigma 2 feature
   pixels, per-channel unit variance), ``(N, 6, C, H_f, W_f)``; targets: the TRUE store's
   ``MatrixLift`` on them. Training and held-out sets are disjoint draws.
4. ``LearnableLift`` on the WRONG store, Adam on MSE, for each learning rate; PSNR (peak = the
   held-out targets' range) of the wrong lift vs the true lift on held-out features before and
   after training, overall and on the BEV cells CAM_FRONT sees in the true matrix.
5. The ceiling: the fraction of the true Top-K support (row, column) pairs that the wrong
   topology contains at all, by count and by true weight, overall and for CAM_FRONT's columns.

Prints one markdown table (docs/learned.md quotes it). Timings are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def smooth_features(rng: np.random.Generator, n: int, n_cam: int, channels: int, h_f: int, w_f: int, sigma: float = 2.0) -> np.ndarray:
    radius = math.ceil(3 * sigma)
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    x = rng.standard_normal((n, n_cam, channels, h_f + 2 * radius, w_f + 2 * radius))
    x = np.apply_along_axis(lambda r: np.convolve(r, taps, mode="valid"), -1, x)
    x = np.apply_along_axis(lambda c: np.convolve(c, taps, mode="valid"), -2, x)
    x /= x.std(axis=(-2, -1), keepdims=True)
    return x.astype(np.float32)


def wrong_rig_data(data: dict, camera: str, yaw_deg: float, shift_m: float, seed: int) -> tuple[dict, np.ndarray]:
    """``data`` with ``camera``'s extrinsics rotated about the ego z axis and translated (sensor2ego form)."""
    from bevcompile.rig.config import parse_config
    from bevcompile.rig.geometry import ego_from_cam_matrix

    rig = parse_config(data, source="<true>")
    index = list(rig.camera_names).index(camera)
    m = ego_from_cam_matrix(rig.cameras[index])
    a = math.radians(yaw_deg)
    yaw = np.array([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0], [0.0, 0.0, 1.0]])
    phi = np.random.default_rng(seed).uniform(0, 2 * math.pi)
    shift = shift_m * np.array([math.cos(phi), math.sin(phi), 0.0])
    new = np.eye(4)
    new[:3, :3] = yaw @ m[:3, :3]
    new[:3, 3] = m[:3, 3] + shift
    cam = dict(data["cameras"][index])
    for key in ("rotation_wxyz", "translation", "rotation", "sensor2ego"):
        cam.pop(key, None)
    cam["sensor2ego"] = new.tolist()
    out = dict(data)
    out["cameras"] = [cam if i == index else c for i, c in enumerate(data["cameras"])]
    return out, shift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", default="1e-3,1e-4", help="comma-separated Adam learning rates")
    parser.add_argument("--yaw-deg", type=float, default=0.5)
    parser.add_argument("--shift-m", type=float, default=0.05)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--train", type=int, default=32, help="training feature sets")
    parser.add_argument("--heldout", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    import torch
    import yaml

    from bevcompile.matrix.build import MatrixOptions, run_matrix
    from bevcompile.rig.config import parse_config
    from bevcompile.torch import LearnableLift, MatrixLift

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = ROOT / "configs" / "nuscenes.yaml"
    data = yaml.safe_load(config.read_text())
    true_rig = parse_config(data, source=str(config))
    wrong_data, shift = wrong_rig_data(data, "CAM_FRONT", args.yaw_deg, args.shift_m, seed=0)
    wrong_rig = parse_config(wrong_data, source="<wrong calibration>")
    options = MatrixOptions(mode="ray", topk=24, align=16)
    front = list(true_rig.camera_names).index("CAM_FRONT")
    w_f, h_f = true_rig.feature_size
    plane = w_f * h_f
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        true_store = run_matrix(true_rig, Path(tmp) / "true", options, jobs=2).store
        wrong_store = run_matrix(wrong_rig, Path(tmp) / "wrong", options, jobs=2).store
        build_s = time.perf_counter() - t0
        true_lift = MatrixLift(true_store)
        true_coo = _coo(true_store)
        wrong_coo = _coo(wrong_store)
        rng = np.random.default_rng(0)
        train_x = torch.from_numpy(smooth_features(rng, args.train, true_rig.n_cam, args.channels, h_f, w_f))
        held_x = torch.from_numpy(smooth_features(rng, args.heldout, true_rig.n_cam, args.channels, h_f, w_f))
        with torch.no_grad():
            train_y = true_lift(train_x)
            held_y = true_lift(held_x)
        peak = float(held_y.max() - held_y.min())
        ny, nx = true_rig.bev.ny, true_rig.bev.nx
        front_cells = np.zeros(ny * nx, dtype=bool)
        front_cells[true_coo[0][true_coo[1] // plane == front]] = True

        def psnr(pred: torch.Tensor, cells: np.ndarray | None = None) -> float:
            diff = (pred - held_y).reshape(pred.shape[0], pred.shape[1], -1)
            if cells is not None:
                diff = diff[:, :, torch.from_numpy(cells)]
            mse = float((diff.double() ** 2).mean())
            return 10 * math.log10(peak * peak / mse) if mse > 0 else math.inf

        rows = []
        for lr in (float(v) for v in args.lr.split(",")):
            torch.manual_seed(0)
            lift = LearnableLift(wrong_store)
            with torch.no_grad():
                before = (psnr(lift(held_x)), psnr(lift(held_x), front_cells))
            opt = torch.optim.Adam(lift.parameters(), lr=lr)
            t1 = time.perf_counter()
            gen = torch.Generator().manual_seed(1)
            for _step in range(args.steps):
                batch = torch.randint(0, args.train, (args.batch,), generator=gen)
                loss = torch.nn.functional.mse_loss(lift(train_x[batch]), train_y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
            train_s = time.perf_counter() - t1
            with torch.no_grad():
                after = (psnr(lift(held_x)), psnr(lift(held_x), front_cells))
            rows.append((lr, before, after, train_s))
        with torch.no_grad():
            true_self = psnr(MatrixLift(true_store)(held_x))

    support = _support(true_coo, wrong_coo, plane, front)
    print(f"rig nuscenes (bundled), ray matrix Top-24 align 16, uniform depth prior; CAM_FRONT yawed {args.yaw_deg} deg about ego z and "
          f"moved {args.shift_m * 100:.0f} cm (direction seed 0: [{shift[0]:+.4f}, {shift[1]:+.4f}, 0] m); {args.channels} channels, smooth "
          f"random features (Gaussian sigma 2 px), {args.train} training / {args.heldout} held-out sets, batch {args.batch}, Adam on MSE; "
          f"two builds {build_s:.1f} s; true lift vs itself: PSNR {true_self}")
    print()
    print("| learning rate | steps | PSNR before (all / CAM_FRONT cells) | PSNR after (all / CAM_FRONT cells) | training time |")
    print("|---|---|---|---|---|")
    for lr, before, after, train_s in rows:
        print(f"| {lr:g} | {args.steps} | {before[0]:.2f} / {before[1]:.2f} dB | {after[0]:.2f} / {after[1]:.2f} dB | {train_s:.1f} s |")
    print()
    print("| true Top-24 support contained in the wrong topology | by count | by true weight |")
    print("|---|---|---|")
    print(f"| all cameras | {100 * support['all'][0]:.2f} % | {100 * support['all'][1]:.2f} % |")
    print(f"| CAM_FRONT columns | {100 * support['front'][0]:.2f} % | {100 * support['front'][1]:.2f} % |")


def _coo(store: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from bevcompile.store.loader import load

    group = load(store)["matrix"]
    return (np.asarray(group["coo_row"], np.int64), np.asarray(group["coo_col"], np.int64), np.asarray(group["coo_val"], np.float64))


def _support(true: tuple[np.ndarray, ...], wrong: tuple[np.ndarray, ...], plane: int, front: int) -> dict[str, tuple[float, float]]:
    n_cols = int(max(true[1].max(), wrong[1].max())) + 1
    in_wrong = np.isin(true[0] * n_cols + true[1], wrong[0] * n_cols + wrong[1])
    out = {}
    for name, mask in (("all", np.ones(true[0].size, dtype=bool)), ("front", true[1] // plane == front)):
        out[name] = (float(in_wrong[mask].mean()), float(true[2][mask & in_wrong].sum() / true[2][mask].sum()))
    return out


if __name__ == "__main__":
    main()
