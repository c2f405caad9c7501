"""Ground-floor helpers with no project imports: mesh-axis helpers (``axes``), matrix
decompositions over a layer batch (``linalg``), tree paths and layer selection
(``tree_paths``), the matrix view of a parameter (``matrices``), the OpenBLAS thread
limit (``cpu_threads``) and the scripts' simulated CPU devices (``cpu_devices``)."""
