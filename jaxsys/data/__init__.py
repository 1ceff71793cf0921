"""Data: corpora, tokenizers, packing (segment ids + positions), grain loaders."""

from jaxsys.data.corpus import list_documents, read_documents, stdlib_root
from jaxsys.data.documents import DocumentLoader, make_document_loader
from jaxsys.data.loader import Loader, make_loader
from jaxsys.data.packing import FIELDS, PackedRows, pack_documents
from jaxsys.data.tokenizer import BPETokenizer, ByteTokenizer, make_tokenizer

__all__ = [
    "FIELDS", "BPETokenizer", "ByteTokenizer", "DocumentLoader", "Loader", "PackedRows", "list_documents",
    "make_document_loader", "make_loader", "make_tokenizer", "pack_documents", "read_documents", "stdlib_root",
]
