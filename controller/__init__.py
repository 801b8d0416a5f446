"""The model control plane: what each model serves (desired state, kept in the repository), and the
loop that makes every discovered Triton server serve exactly that (docs/control-plane.md)."""
