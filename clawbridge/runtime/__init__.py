"""The running instance: one server per state dir, where it listens, its keys, time, background loops, ending sessions, files that survive a power loss, and test-only fault points."""
