import os
import signal
import sys
import time

# detach from the terminal's output so the shell that started us is not held open
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)

count = 0


def on_term(signum, frame):
    with open("/app/ticker.status", "w") as f:
        f.write(f"stopped by SIGTERM after {count} ticks\n")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
with open("/app/ticks.log", "a") as log:
    while True:
        count += 1
        log.write(f"tick {count}\n")
        log.flush()
        time.sleep(0.2)
