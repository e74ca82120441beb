"""Train LettuceDetect's token classifier with its own Trainer on all-MiniLM-L6-v2 (issue 75, the "peer").

Run with the LettuceDetect venv (lettucedetect==0.2.3, nothing of halwatch installed):

    /work/ldvenv/bin/python train.py --model MINILM_DIR --data DATA_DIR --output-dir OUT_DIR

DATA_DIR holds train.json and dev.json written by export.py (halwatch's RAGTruth QA train and dev splits in
LettuceDetect's sample format). The recipe is LettuceDetect's ``scripts/train.py`` (KRLabsOrg/LettuceDetect) with
its defaults: seed 123, ``HallucinationDataset`` (context truncated first, labels on answer tokens only),
``DataCollatorForTokenClassification`` (label pad -100), batch size 4, shuffled train loader, AdamW at a constant
learning rate 1e-5 (no scheduler, no warm-up), 6 epochs, evaluation on the dev loader after every epoch, and the
model with the best dev token-level hallucinated-class F1 kept. Changes, each for a reason:

* ``max_length`` 512 instead of the library's 4096: MiniLM has 512 position embeddings.
* the dev set is halwatch's ``dev`` split (a fifth of the official train split's sources, source-disjoint from
  ``train``) instead of a random 10% of the train answers, so the peer trains on exactly halwatch's ``train``.
* the Trainer is driven one epoch per ``train()`` call on the same Trainer object (same model, same AdamW state,
  same DataLoader, same RNG stream: the same sequence of updates as one ``train()`` over 6 epochs) so that the
  driver can keep the best epoch itself and write a resumable state after each epoch. ``Trainer.train()`` starts its
  own best F1 at 0, so each call saves its epoch into OUT_DIR/epoch-N; the driver moves it to OUT_DIR/best when its
  dev F1 beats the best so far (ties keep the earlier epoch, as in the library) and deletes it otherwise.

Restarting: after each finished epoch the driver writes OUT_DIR/last/state.pt (model and AdamW state, the torch /
numpy / python RNG states, the epochs done, the best F1 and the per-epoch history). Run the same command again and it
resumes after the last finished epoch, exactly (the shuffle order of the next epoch comes from the restored torch RNG);
the epoch that was running when it stopped is redone from its start. ``--fresh`` ignores and overwrites the saved
state. OUT_DIR/best is a plain ``save_pretrained`` folder that evaluate.py (and LettuceDetect's
``HallucinationDetector``) loads; OUT_DIR/history.json lists every epoch's dev metrics and times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder; never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not sys.stdout.isatty():  # tqdm bars in a log file: one line every 30 s instead of a redraw per step
    os.environ.setdefault("TQDM_MININTERVAL", "30")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
)

from lettucedetect.datasets.hallucination_dataset import HallucinationData, HallucinationDataset  # noqa: E402
from lettucedetect.models.trainer import Trainer  # noqa: E402

SEED = 123  # LettuceDetect's scripts/train.py seeds everything with 123


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_split(path: Path, limit: int | None):
    samples = HallucinationData.from_json(json.loads(path.read_text())).samples
    return samples[:limit] if limit else samples


class TimedCollator:
    """LettuceDetect's collator, noting when each batch is built (the train loop's step times, for estimates)."""

    def __init__(self, collator):
        self.collator, self.stamps, self.lengths = collator, [], []

    def __call__(self, features):
        batch = self.collator(features)
        self.stamps.append(time.perf_counter())
        self.lengths.append(int(batch["input_ids"].shape[1]))
        return batch

    def take(self):
        stamps, lengths, self.stamps, self.lengths = self.stamps, self.lengths, [], []
        return stamps, lengths


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="folder of the pretrained encoder (all-MiniLM-L6-v2)")
    parser.add_argument("--data", required=True, type=Path, help="folder with train.json and dev.json (export.py)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--max-length", type=int, default=512, help="LettuceDetect: 4096; MiniLM has 512 positions")
    parser.add_argument("--limit", type=int, default=None, help="first N train answers only (smoke tests)")
    parser.add_argument("--dev-limit", type=int, default=None, help="first N dev answers only (smoke tests)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, as the library)")
    parser.add_argument("--fresh", action="store_true", help="ignore a saved state in OUTPUT_DIR/last and start over")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "last" / "state.pt"
    seed_everything(SEED)

    train_samples = read_split(args.data / "train.json", args.limit)
    dev_samples = read_split(args.data / "dev.json", args.dev_limit)
    assert all(s.split == "train" for s in train_samples) and all(s.split == "dev" for s in dev_samples)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collator = TimedCollator(DataCollatorForTokenClassification(tokenizer=tokenizer, label_pad_token_id=-100))
    train_loader = DataLoader(HallucinationDataset(train_samples, tokenizer, max_length=args.max_length),
                              batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    dev_loader = DataLoader(HallucinationDataset(dev_samples, tokenizer, max_length=args.max_length),
                            batch_size=args.batch_size, shuffle=False,
                            collate_fn=DataCollatorForTokenClassification(tokenizer=tokenizer, label_pad_token_id=-100))
    model = AutoModelForTokenClassification.from_pretrained(args.model, num_labels=2)
    device = torch.device(args.device) if args.device else None
    trainer = Trainer(model=model, tokenizer=tokenizer, train_loader=train_loader, test_loader=dev_loader,
                      epochs=1, learning_rate=args.learning_rate, save_path=str(out / "epoch-0"), device=device)

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "fresh"}
    config.update(seed=SEED, n_train=len(train_samples), n_dev=len(dev_samples), steps_per_epoch=len(train_loader))
    done, best_f1, history = 0, 0.0, []
    if state_path.is_file() and not args.fresh:
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        changed = {k: (state["config"].get(k), v) for k, v in config.items()
                   if k not in ("epochs", "threads", "device") and state["config"].get(k) != v}
        if changed:
            sys.exit(f"{state_path} was made with other settings {changed}: rerun with --fresh or another folder")
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        done, best_f1, history = state["epochs_done"], state["best_f1"], state["history"]
        print(f"resuming from {state_path}: {done} epochs done, best dev F1 {best_f1:.4f}", flush=True)
    print(f"train {len(train_samples)} answers ({len(train_loader)} steps of {args.batch_size}/epoch), "
          f"dev {len(dev_samples)}, max_length {args.max_length}, lr {args.learning_rate}, epochs {args.epochs}, "
          f"{args.threads} threads, device {trainer.device}", flush=True)

    for epoch in range(done + 1, args.epochs + 1):
        print(f"\n=== epoch {epoch}/{args.epochs} (LettuceDetect Trainer, one epoch per call) ===", flush=True)
        trainer.save_path = str(out / f"epoch-{epoch}")
        started = time.perf_counter()
        f1 = trainer.train()  # trains one epoch, evaluates on dev, saves to save_path when dev F1 > 0
        wall = time.perf_counter() - started
        stamps, lengths = collator.take()
        step_s = float(np.mean(np.diff(stamps))) if len(stamps) > 1 else float("nan")
        saved = out / f"epoch-{epoch}"
        improved = f1 > best_f1
        if improved:
            best_f1 = f1
            if (out / "best").exists():
                shutil.rmtree(out / "best")
            saved.rename(out / "best")
        elif saved.exists():
            shutil.rmtree(saved)
        if not (out / "best").exists():  # dev F1 0 so far (tiny smoke runs): keep the latest model as "best"
            trainer.model.save_pretrained(out / "best")
            tokenizer.save_pretrained(out / "best")
        history.append({"epoch": epoch, "dev_hallucinated_token_f1": f1, "best": improved, "wall_s": wall,
                        "train_steps": len(stamps), "mean_train_step_s": step_s,
                        "mean_padded_length": float(np.mean(lengths)) if lengths else None})
        state_path.parent.mkdir(exist_ok=True)
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "rng": rng_state(), "epochs_done": epoch, "best_f1": best_f1, "history": history,
                    "config": config}, tmp)
        tmp.replace(state_path)
        (out / "history.json").write_text(json.dumps({"config": config, "epochs": history}, indent=1))
        print(f"[driver] epoch {epoch}: dev token F1 (hallucinated) {f1:.4f}, best {best_f1:.4f}"
              f"{' (new best -> best/)' if improved else ''}; {wall:.1f} s in all, "
              f"{step_s:.2f} s per train step of {args.batch_size} (mean padded length "
              f"{history[-1]['mean_padded_length']}); state -> {state_path}", flush=True)

    print(json.dumps({"best_dev_hallucinated_token_f1": best_f1, "best_model": str(out / "best"),
                      "epochs": history}, indent=1))


if __name__ == "__main__":
    main()
