"""The four stage actors: each a process that receives, unpacks, decides, packs and sends."""
