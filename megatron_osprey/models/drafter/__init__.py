"""The drafters: Osprey (adapted backbone) and the EAGLE-3 baseline, their TTT attention, conversion and adaptation."""
