"""What the poros executor runs a plan with: device buffers, layer runners and templates, saved inputs."""
