"""Jinja templates (data): cuda/*.cu.j2, ascend/*.cpp.j2."""
