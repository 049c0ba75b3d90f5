"""What lives on disk: the index of slot files, parks and project heads, the slot-file names and
headers, the event log, cleanup (gc) and keeping all of it private."""
