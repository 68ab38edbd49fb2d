//! Read-only FUSE filesystem over a sealed version (see issue: lazy verified mount).
