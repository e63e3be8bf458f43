"""The kernel-log wing: follow /dev/kmsg, parse and classify GPU errors, latch, count rates."""
