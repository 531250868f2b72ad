"""Plans and communication: which rank owns which positions, the collectives, the
autograd Functions that move rows across the CP group, and the row primitives (torch custom ops)."""
