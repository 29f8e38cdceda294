// The FerryUplink module. Its sources land in this folder.
