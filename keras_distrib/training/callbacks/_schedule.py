"""When to save: once per epoch, or every `save_freq` batches.

One counter shared by every saving callback (Keras keeps three copies).
Keras reports the index of the last batch of each `steps_per_execution`
chunk, so the counter adds the batches since the last report.
"""

from keras_distrib import validation


def check_save_freq(save_freq):
    if save_freq == "epoch":
        return save_freq
    if not validation.is_whole(save_freq, 1):
        raise ValueError(
            f"`save_freq`={save_freq!r} must be 'epoch' or a whole number of "
            "batches >= 1."
        )
    return save_freq


class SaveSchedule:
    """Counts batches and says when a batch-frequency save is due."""

    def __init__(self, save_freq):
        self.save_freq = check_save_freq(save_freq)
        self._last_batch = -1
        self._since_save = 0

    @property
    def per_epoch(self):
        return self.save_freq == "epoch"

    def new_epoch(self):
        self._last_batch = -1

    def batch_done(self, batch):
        """Records that batches up to index `batch` ran; True if a save is due."""
        done = batch - self._last_batch if batch > self._last_batch else batch + 1
        self._last_batch = batch
        if self.per_epoch:
            return False
        self._since_save += done
        if self._since_save >= self.save_freq:
            self._since_save = 0
            return True
        return False
