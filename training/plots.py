"""The training-curves PNG: loss and accuracy per epoch, plus the per-step training loss."""

from __future__ import annotations

from pathlib import Path

from training.metrics import History


def plot_curves(history: History, path: Path) -> None:
    # Imported here, not at the top: only a completed job plots, and pyplot adds ~0.3 s to every trainer
    # start (each rank, each life, each restart after a spot notice).
    import matplotlib

    matplotlib.use("Agg")  # instances have no display
    import matplotlib.pyplot as plt

    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    if history.step_losses:
        steps, losses = zip(*history.step_losses, strict=True)
        loss_axes.plot(steps, losses, color="0.7", linewidth=1, label="train (per log line)")
    epoch_steps = [e.step for e in history.epochs]
    loss_axes.plot(epoch_steps, [e.train_loss for e in history.epochs], "o-", label="train (epoch)")
    loss_axes.plot(epoch_steps, [e.val_loss for e in history.epochs], "o-", label="validation")
    # Log scale: early validation loss can be 100x the final one and would flatten everything else.
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss", yscale="log")
    loss_axes.legend()
    epochs = [e.epoch for e in history.epochs]
    accuracy_axes.plot(epochs, [e.train_accuracy for e in history.epochs], "o-", label="train")
    accuracy_axes.plot(epochs, [e.val_accuracy for e in history.epochs], "o-", label="validation")
    # Headroom above 1.0 so that a perfect epoch's marker is drawn whole, not cut by the frame.
    accuracy_axes.set(
        xlabel="epoch",
        ylabel="top-1 accuracy",
        title="Accuracy",
        ylim=(0, 1.05),
        yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0],
        xticks=epochs,
    )
    accuracy_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
