// The FerryStore module. Its sources land in this folder.
