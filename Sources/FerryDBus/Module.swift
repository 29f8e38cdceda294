// The FerryDBus module. Its sources land in this folder.
