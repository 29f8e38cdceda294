// The FerryBlueZ module. Its sources land in this folder.
