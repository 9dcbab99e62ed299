"""The run directory's formats, read and written without torch: by the user's process (launch,
resize, status) and by the ranks."""
