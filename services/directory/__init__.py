"""services/directory"""
