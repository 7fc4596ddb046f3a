"""DeepSeek-V4.1's Hugging Face side: the released tensor names (``v41_names``), the
``config.json`` map (``v41_config_map``), the release's quantized formats and which tensor
takes which (``v41_quant``, ``v41_quant_layout``), the folder reader (``v41_quant_folder``),
the import plan (``v41_import``) and the export's released layout (``v41_hf_export``); the
family's ``HFMapping`` (``v41_family.py``) hands them to ``engram-import-hf`` and
``engram-export --format hf``."""
