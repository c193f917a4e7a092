"""What is loaded where: ModelHost (engine + context pool), ModelCache (byte budget), footprints."""
