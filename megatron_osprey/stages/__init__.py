"""The pipeline's stages, one module each: its Config and the function that runs it.

A stage composes the layers below it (models, data, training, export, eval); nothing
below imports a stage.
"""
