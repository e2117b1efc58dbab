"""`multislice plan`: the Multislice overview's DCN arithmetic, made executable.

formulas: the seed's formulas (DCN bits per parameter, operational intensity, minimum batch).
cost: one candidate mesh's memory per chip and DCN traffic.
pipeline: the bubble and activation traffic of a pipeline axis.
recommend: the parallelism across slices the overview's reasoning picks.
planner: a whole plan from inputs; output: as text and JSON; command: the CLI and its inputs.
"""
