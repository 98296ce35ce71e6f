"""The GPU check (`scripts/gpu-check`), standard library only: its steps, the serve load,
the paper's comparison."""
