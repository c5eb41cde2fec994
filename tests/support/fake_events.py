"""CUDA events on a clock a test advances (ms), for the replay judge where no GPU runs."""


class EventClock:
    """Call it for a new event (as torch.cuda.Event): record() stamps the clock's `now`, every
    event is done while `done` is True (a test sets it False for a GPU that lags), and
    elapsed_time is the difference of two stamps; `made` counts the events made."""

    def __init__(self) -> None:
        self.now, self.made, self.done = 0.0, 0, True

    def __call__(self, enable_timing: bool = True):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def query(self):
                return clock.done

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at
        self.made += 1
        return Event()
