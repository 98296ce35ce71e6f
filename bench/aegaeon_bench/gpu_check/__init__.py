"""The GPU check (`scripts/gpu-check`), standard library only."""
