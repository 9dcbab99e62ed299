"""Planning: costs, memory, partitioning, the event-driven simulator, search and the morph table.

Nothing in this package imports torch or DeepSpeed, and this file imports nothing, so
`import pipectl.plan.simulate` stays fast.
"""
