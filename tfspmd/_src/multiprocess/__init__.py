"""The multiprocess layer: several processes running one program. Starting and
joining them, a lost peer's error, and the check that every process traced the
same program.
"""
