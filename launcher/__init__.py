"""The `osprey` command: recipes -> local torchrun / python, or sbatch jobs from the top-level slurm/ templates."""
