"""The package list, which pyproject.toml alone cannot state: every package under eagle3_assets/,
plus the repository's top-level resources/ and sensors/ folders installed *inside* it, as
eagle3_assets.resources and eagle3_assets.sensors. The folders stay at the top of the repository
(where they are read), but the wheel ships a single top-level name, eagle3_assets, so no generic
`resources` or `sensors` package collides with another distribution's. Everything else is in
pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

INSIDE = {"eagle3_assets.resources": "resources", "eagle3_assets.sensors": "sensors"}

# namespace folders too: the bundled data folders and the SGLang CPU hook ship as package data
packages = find_namespace_packages(include=["eagle3_assets", "eagle3_assets.*"], exclude=["*__pycache__*"])
for name, folder in INSIDE.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_namespace_packages(where=folder, exclude=["*__pycache__*"])]

setup(packages=packages, package_dir={name: folder for name, folder in INSIDE.items()})
