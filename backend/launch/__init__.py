"""What a launch is prepared from: preflight checks, the plan of jobs, the code bundle, images, presets, limits."""
