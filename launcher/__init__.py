"""The `osprey` command: recipes -> local torchrun / python, or sbatch jobs from launcher/slurm/."""
