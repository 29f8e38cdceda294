// The FerrySimulator module. Its sources land in this folder.
